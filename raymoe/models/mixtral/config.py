"""Mixtral's ``config.json`` (transformers' ``MixtralConfig``): its defaults and the router jitter it refuses."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from raymoe.models.common.config import ConfigDefaults, ModelConfig, parse_decoder_config

MIXTRAL_DEFAULTS = ConfigDefaults(
    max_position_embeddings=4096 * 32,
    has_moe=True,
    rms_norm_eps=1e-5,
    expert_size_field="intermediate_size",
    norm_topk_prob=True,  # Mixtral always renormalises its top-k probabilities
    sliding_window="all",
    rope_theta=1_000_000.0,
)


def parse_mixtral_config(raw: Mapping[str, Any]) -> ModelConfig:
    """A Mixtral :class:`ModelConfig` (RoPE theta defaults to 1e6, as in transformers)."""
    jitter = raw.get("router_jitter_noise") or 0.0
    if jitter:
        raise ValueError(
            f"config.json router_jitter_noise={jitter!r}: router jitter (random input noise while training) "
            "is not implemented in raymoe; set it to 0"
        )
    return parse_decoder_config(raw, MIXTRAL_DEFAULTS)
