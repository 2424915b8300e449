"""gpt-oss's ``config.json`` (transformers' ``GptOssConfig``): its defaults and the fields only it has.

Besides the shared decoder fields: the clamped SwiGLU (``swiglu_alpha``, ``swiglu_limit``), biases on
the router and both expert projections, attention sinks, alternating sliding/full attention
(``layer_types``, ``sliding_window``) and YaRN RoPE when ``rope_parameters`` is absent. A checkpoint
quantized by any method but MXFP4 (``quantization_config.quant_method``) is refused.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from raymoe.models.common.activation import GatedActivation
from raymoe.models.common.config import ConfigDefaults, ConfigFields, ModelConfig, parse_decoder_config

GPT_OSS_DEFAULTS = ConfigDefaults(
    max_position_embeddings=131072,
    head_dim=64,
    has_moe=True,
    rms_norm_eps=1e-5,
    attention_bias=True,
    expert_size_field="intermediate_size",
    norm_topk_prob=True,  # a softmax over the top-k logits
    sliding_window="layer_types",
    default_sliding_window=128,
    rope_theta=150000.0,
    # transformers' GptOssConfig default when a config.json has no rope_parameters.
    rope_parameters={
        "rope_type": "yarn",
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 4096,
    },
)
SUPPORTED_QUANTIZATION = ("mxfp4",)


def parse_gpt_oss_config(raw: Mapping[str, Any]) -> ModelConfig:
    """A gpt-oss :class:`ModelConfig` from the dict of its ``config.json``."""
    _check_quantization(raw.get("quantization_config"))
    config = parse_decoder_config(raw, GPT_OSS_DEFAULTS)
    fields = ConfigFields(raw, "gpt_oss")
    activation = GatedActivation(
        interleaved=True,
        clamp_limit=fields.positive_float("swiglu_limit", default=7.0),
        alpha=fields.positive_float("swiglu_alpha", default=1.702),
    )
    assert config.moe is not None  # GPT_OSS_DEFAULTS.has_moe
    moe = dataclasses.replace(config.moe, router_bias=True, expert_bias=True, activation=activation)
    return dataclasses.replace(config, moe=moe, attention_sinks=True)


def _check_quantization(quantization: Any) -> None:
    if quantization is None:
        return
    method = quantization.get("quant_method") if isinstance(quantization, dict) else None
    if method not in SUPPORTED_QUANTIZATION:
        raise ValueError(
            f"config.json quantization_config.quant_method={method!r}: raymoe reads gpt-oss checkpoints in "
            f"{', '.join(SUPPORTED_QUANTIZATION)} or unquantized"
        )
