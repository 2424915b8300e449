"""Qwen2-MoE's ``config.json`` (transformers' ``Qwen2MoeConfig``): its defaults and the fields only it has.

Besides the shared decoder and routed-expert fields: ``qkv_bias`` (biases on q/k/v, never on o_proj;
default true) and ``shared_expert_intermediate_size``, the width of the shared expert every token runs,
scaled by ``sigmoid(shared_expert_gate(x))``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from raymoe.models.common.config import ConfigDefaults, ConfigFields, ModelConfig, parse_decoder_config

QWEN2_MOE_DEFAULTS = ConfigDefaults(max_position_embeddings=32768, has_moe=True)
DEFAULT_SHARED_EXPERT_SIZE = 5632  # Qwen2MoeConfig's


def parse_qwen2_moe_config(raw: Mapping[str, Any]) -> ModelConfig:
    """A Qwen2-MoE :class:`ModelConfig` from the dict of its ``config.json``."""
    config = parse_decoder_config(raw, QWEN2_MOE_DEFAULTS)
    fields = ConfigFields(raw, "qwen2_moe")
    assert config.moe is not None  # QWEN2_MOE_DEFAULTS.has_moe
    moe = dataclasses.replace(
        config.moe,
        shared_expert_intermediate_size=fields.positive_int(
            "shared_expert_intermediate_size", default=DEFAULT_SHARED_EXPERT_SIZE
        ),
        shared_expert_gate=True,
    )
    qkv_bias = fields.boolean("qkv_bias", default=True)
    return dataclasses.replace(config, moe=moe, attention_bias=qkv_bias, attention_output_bias=False)
