"""DeepSeek-V3's ``config.json`` (transformers' ``DeepseekV3Config``): its defaults and the fields only it has.

Multi-head latent attention (:class:`MlaConfig`): ``q_lora_rank`` (null: a plain ``q_proj``), ``kv_lora_rank``,
``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``, ``rope_interleave``; ``attention_bias`` puts biases
on ``q_a_proj``, ``kv_a_proj_with_mqa`` and ``o_proj``. YaRN RoPE scales the softmax by ``mscale(factor,
mscale_all_dim)^2`` besides cos/sin. Feed-forward: sigmoid routing with ``e_score_correction_bias``,
``n_group`` / ``topk_group``, ``norm_topk_prob`` (default true), ``routed_scaling_factor``, ``n_shared_experts``,
the first ``first_k_dense_replace`` layers dense. Checkpoints may be block-scaled FP8
(``quantization_config.quant_method: fp8``, ``weight_block_size``); any other quantization is refused.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from raymoe.models.common.config import ConfigDefaults, ConfigFields, MlaConfig, ModelConfig, parse_decoder_config

DEEPSEEK_V3_DEFAULTS = ConfigDefaults(
    max_position_embeddings=4096,
    has_moe=True,
    router_selection_bias=True,
    grouped_sigmoid_routing={
        "n_group": 8,
        "topk_group": 4,
        "routed_scaling_factor": 2.5,
        "n_shared_experts": 1,
        "first_k_dense_replace": 3,
    },
)
FP8_METHOD = "fp8"
DEFAULT_FP8_BLOCK = (128, 128)


def parse_deepseek_v3_config(raw: Mapping[str, Any]) -> ModelConfig:
    """A DeepSeek-V3 :class:`ModelConfig` from the dict of its ``config.json``."""
    fp8_block_size(raw)  # a bad quantization_config fails here, on the driver
    fields = ConfigFields(raw, "deepseek_v3")
    rope_dim = fields.positive_int("qk_rope_head_dim", default=64)
    if rope_dim % 2:
        raise ValueError(f"config.json qk_rope_head_dim={rope_dim} must be even for rotary embeddings")
    # head_dim is the rotated part of a head, as in transformers (what RoPE is computed for).
    config = dataclasses.replace(
        parse_decoder_config({**raw, "head_dim": rope_dim}, DEEPSEEK_V3_DEFAULTS), raw=dict(raw)
    )
    if config.num_key_value_heads != config.num_attention_heads:
        raise ValueError(
            f"config.json num_key_value_heads={config.num_key_value_heads} must equal num_attention_heads="
            f"{config.num_attention_heads}: multi-head latent attention expands keys and values per query head"
        )
    q_lora_rank = raw.get("q_lora_rank", 1536)
    if q_lora_rank is not None:
        q_lora_rank = fields.positive_int("q_lora_rank")
    nope_dim = fields.positive_int("qk_nope_head_dim", default=128)
    mla = MlaConfig(
        q_lora_rank=q_lora_rank,
        kv_lora_rank=fields.positive_int("kv_lora_rank", default=512),
        qk_nope_head_dim=nope_dim,
        qk_rope_head_dim=rope_dim,
        v_head_dim=fields.positive_int("v_head_dim", default=128),
        rope_interleave=fields.boolean("rope_interleave", default=True),
        softmax_scale=(nope_dim + rope_dim) ** -0.5 * _yarn_softmax_mscale(config) ** 2,
    )
    assert config.moe is not None  # DEEPSEEK_V3_DEFAULTS.has_moe
    moe = dataclasses.replace(config.moe, norm_topk_prob=fields.boolean("norm_topk_prob", default=True))
    return dataclasses.replace(config, moe=moe, mla=mla)


def _yarn_softmax_mscale(config: ModelConfig) -> float:
    """YaRN's ``0.1 * mscale_all_dim * ln(factor) + 1`` (1 without YaRN, a factor <= 1 or mscale_all_dim)."""
    rope = config.rope
    if rope.kind != "yarn" or not rope.mscale_all_dim or rope.factor <= 1:
        return 1.0
    return 0.1 * rope.mscale_all_dim * math.log(rope.factor) + 1.0


def fp8_block_size(raw: Mapping[str, Any]) -> tuple[int, int] | None:
    """The FP8 block ``(rows, cols)`` of a block-scaled checkpoint, None when it is not quantized."""
    quantization = raw.get("quantization_config")
    if quantization is None:
        return None
    method = quantization.get("quant_method") if isinstance(quantization, dict) else None
    if method != FP8_METHOD:
        raise ValueError(
            f"config.json quantization_config.quant_method={method!r}: raymoe reads DeepSeek-V3 checkpoints "
            "block-scaled in fp8 or unquantized"
        )
    fmt = quantization.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"config.json quantization_config.fmt={fmt!r}: raymoe reads fp8 checkpoints in e4m3")
    block = quantization.get("weight_block_size", list(DEFAULT_FP8_BLOCK))
    if not (
        isinstance(block, list | tuple)
        and len(block) == 2
        and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    ):
        raise ValueError(
            f"config.json quantization_config.weight_block_size={block!r} must be two positive integers (rows, cols)"
        )
    return int(block[0]), int(block[1])
