"""Rotary embeddings against transformers 5.23: YaRN frequencies, attention scaling and cos/sin (CPU, fp32).

Each case is one ``config.json`` dict, parsed by raymoe and by transformers' ``LlamaConfig`` alike, so the
defaults each side fills in (``original_max_position_embeddings``, beta, truncate) are compared too.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from raymoe.models import parse_model_config
from raymoe.models.common.rope import attention_scaling, inverse_frequencies, rope_cos_sin

GPT_OSS_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
    "rope_theta": 150000.0,
}

YARN_CASES: dict[str, dict[str, Any]] = {
    "gpt_oss": {"max_position_embeddings": 131072, "rope_parameters": GPT_OSS_ROPE},
    # Qwen-style: truncate and beta left to their defaults (truncate on), legacy spelling.
    "qwen_truncated": {
        "max_position_embeddings": 131072,
        "rope_theta": 1e6,
        "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
    },
    "truncate_true_narrow_band": {
        "max_position_embeddings": 16384,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 5e5,
            "factor": 8.0,
            "beta_fast": 16.0,
            "beta_slow": 2.0,
            "truncate": True,
            "original_max_position_embeddings": 2048,
        },
    },
    "attention_factor_given": {
        "max_position_embeddings": 8192,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 1e4,
            "factor": 4.0,
            "attention_factor": 1.25,
            "mscale": 1.0,
            "mscale_all_dim": 0.5,
            "original_max_position_embeddings": 2048,
        },
    },
    # DeepSeek-V2/V3 style: equal mscale and mscale_all_dim give an attention factor of 1.
    "deepseek_mscale_equal": {
        "max_position_embeddings": 163840,
        "rope_theta": 1e4,
        "rope_scaling": {
            "type": "yarn",
            "factor": 40,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
            "original_max_position_embeddings": 4096,
        },
    },
    "mscale_ratio": {
        "max_position_embeddings": 65536,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 1e4,
            "factor": 16.0,
            "mscale": 1.0,
            "mscale_all_dim": 0.5,
            "original_max_position_embeddings": 4096,
        },
    },
    # mscale_all_dim 0 (DeepSeek's own default): transformers then ignores both mscales.
    "mscale_all_dim_zero": {
        "max_position_embeddings": 65536,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 1e4,
            "factor": 16.0,
            "mscale": 0.707,
            "mscale_all_dim": 0,
            "original_max_position_embeddings": 4096,
        },
    },
    # No original context in the rope dict: it is max_position_embeddings (so factor alone extends it).
    "original_from_max_positions": {
        "max_position_embeddings": 4096,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0},
    },
    "original_top_level": {
        "max_position_embeddings": 8192,
        "original_max_position_embeddings": 1024,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 1e4,
            "factor": 8.0,
            "original_max_position_embeddings": 2048,
        },
    },
    "factor_null_is_context_ratio": {
        "max_position_embeddings": 8192,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 1e4,
            "factor": None,
            "original_max_position_embeddings": 1024,
        },
    },
    # The band collapses to one point: transformers widens it by 0.001 instead of dividing by zero.
    "equal_betas_truncated": {
        "max_position_embeddings": 8192,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 1e4,
            "factor": 4.0,
            "beta_fast": 4.0,
            "beta_slow": 4.0,
            "original_max_position_embeddings": 2048,
        },
    },
}

POSITIONS = torch.arange(301)
TOLERANCE = 1e-6


def _raw(case: str, head_dim: int) -> dict[str, Any]:
    fields = {
        "model_type": "llama",
        "vocab_size": 100,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": head_dim,
    }
    return fields | copy.deepcopy(YARN_CASES[case])


def _reference(raw: dict[str, Any]) -> tuple[torch.Tensor, float, torch.Tensor, torch.Tensor]:
    """transformers' ``inv_freq [head_dim/2]``, attention factor and ``cos, sin [S, head_dim]``."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = transformers.LlamaConfig.from_dict(copy.deepcopy(raw))
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    cos, sin = LlamaRotaryEmbedding(config)(torch.zeros(1, dtype=torch.float32), POSITIONS[None])
    return inv_freq, float(factor), cos[0], sin[0]


@pytest.mark.parametrize("head_dim", [8, 64])
@pytest.mark.parametrize("case", list(YARN_CASES))
def test_yarn_matches_transformers(case, head_dim):
    raw = _raw(case, head_dim)
    ref_inv_freq, ref_factor, ref_cos, ref_sin = _reference(raw)
    rope = parse_model_config(raw).rope
    assert rope.kind == "yarn"

    inv_freq = inverse_frequencies(rope, head_dim, torch.device("cpu"))
    assert inv_freq.dtype == torch.float32 and inv_freq.shape == (head_dim // 2,)
    torch.testing.assert_close(inv_freq, ref_inv_freq, rtol=0, atol=TOLERANCE)
    assert attention_scaling(rope) == pytest.approx(ref_factor, rel=1e-12)

    cos, sin = rope_cos_sin(rope, head_dim, POSITIONS, torch.float32)
    assert cos.shape == sin.shape == (len(POSITIONS), head_dim)
    torch.testing.assert_close(cos, ref_cos, rtol=0, atol=TOLERANCE)
    torch.testing.assert_close(sin, ref_sin, rtol=0, atol=TOLERANCE)


def test_gpt_oss_rotary_embedding_agrees():
    """gpt-oss's own rotary module returns half-width cos/sin; ours repeats them for channel i + head_dim/2."""
    import transformers
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    head_dim = 64
    config = transformers.GptOssConfig(
        hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, num_hidden_layers=2
    )
    assert config.rope_parameters == GPT_OSS_ROPE  # the hub config is transformers' default
    ref_cos, ref_sin = GptOssRotaryEmbedding(config)(torch.zeros(1, dtype=torch.float32), POSITIONS[None])
    rope = parse_model_config(_raw("gpt_oss", head_dim)).rope
    cos, sin = rope_cos_sin(rope, head_dim, POSITIONS, torch.float32)
    torch.testing.assert_close(cos, ref_cos[0].repeat(1, 2), rtol=0, atol=TOLERANCE)
    torch.testing.assert_close(sin, ref_sin[0].repeat(1, 2), rtol=0, atol=TOLERANCE)


def test_attention_scaling_multiplies_cos_sin_before_the_cast():
    rope = parse_model_config(_raw("gpt_oss", 64)).rope
    scale = attention_scaling(rope)
    assert scale == pytest.approx(1 + 0.1 * torch.log(torch.tensor(32.0)).item())
    cos, sin = rope_cos_sin(rope, 64, POSITIONS, torch.float32)
    cos_bf16, sin_bf16 = rope_cos_sin(rope, 64, POSITIONS, torch.bfloat16)
    assert cos[0, 0].item() == pytest.approx(scale)  # position 0: cos = 1, scaled
    assert torch.equal(cos_bf16, cos.to(torch.bfloat16)) and torch.equal(sin_bf16, sin.to(torch.bfloat16))


def test_other_kinds_are_unscaled():
    for fields in ({}, {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}):
        raw = {k: v for k, v in _raw("gpt_oss", 8).items() if k != "rope_parameters"} | fields
        rope = parse_model_config(raw).rope
        assert attention_scaling(rope) == 1.0
        cos, _ = rope_cos_sin(rope, 8, POSITIONS, torch.float32)
        assert torch.equal(cos[0], torch.ones(8))
