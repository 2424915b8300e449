"""GLM-4.5's ``config.json`` (transformers' ``Glm4MoeConfig``): its defaults and the fields only it has.

Attention: GQA with biases on q/k/v only (``attention_bias``), per-head q/k RMSNorm when ``use_qk_norm``,
RoPE on the first ``partial_rotary_factor`` (default 0.5) of each head. Feed-forward: DeepSeek-V3's
routing (sigmoid scores, ``e_score_correction_bias``, ``n_group`` / ``topk_group``, ``norm_topk_prob``
default true, ``routed_scaling_factor``), ``n_shared_experts`` shared experts, the first
``first_k_dense_replace`` layers dense. The multi-token-prediction layers are not part of the model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from raymoe.models.common.config import ConfigDefaults, ConfigFields, ModelConfig, parse_decoder_config

GLM4_MOE_DEFAULTS = ConfigDefaults(
    max_position_embeddings=131072,
    has_moe=True,
    router_selection_bias=True,
    rms_norm_eps=1e-5,
    partial_rotary_factor=0.5,
    grouped_sigmoid_routing={
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 1.0,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
    },
)


def parse_glm4_moe_config(raw: Mapping[str, Any]) -> ModelConfig:
    """A GLM-4.5 :class:`ModelConfig` from the dict of its ``config.json``."""
    config = parse_decoder_config(raw, GLM4_MOE_DEFAULTS)
    fields = ConfigFields(raw, "glm4_moe")
    assert config.moe is not None  # GLM4_MOE_DEFAULTS.has_moe
    moe = dataclasses.replace(config.moe, norm_topk_prob=fields.boolean("norm_topk_prob", default=True))
    return dataclasses.replace(
        config, moe=moe, qk_norm=fields.boolean("use_qk_norm", default=False), attention_output_bias=False
    )
