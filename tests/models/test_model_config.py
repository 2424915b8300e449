"""Parsing config.json into ModelConfig: supported types, required fields, defaults, refusals."""

from __future__ import annotations

import json

import pytest

from raymoe.models import MODEL_CLASSES, SUPPORTED_MODEL_TYPES, RopeConfig, load_model_config, parse_model_config

QWEN3_MOE = {
    "model_type": "qwen3_moe",
    "vocab_size": 100,
    "hidden_size": 32,
    "intermediate_size": 48,
    "moe_intermediate_size": 16,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_experts": 8,
    "num_experts_per_tok": 2,
}
LLAMA = {k: v for k, v in QWEN3_MOE.items() if "expert" not in k and k != "moe_intermediate_size"} | {
    "model_type": "llama"
}


def test_every_supported_type_has_a_model_class():
    assert set(MODEL_CLASSES) == set(SUPPORTED_MODEL_TYPES)


def test_unknown_model_type_lists_the_supported_ones():
    with pytest.raises(
        ValueError,
        match=r"model_type='kimi_linear' is not supported; supported model types: llama, qwen3, qwen3_moe, qwen2_moe, "
        "glm4_moe, deepseek_v3, mixtral, gpt_oss",
    ):
        parse_model_config({**QWEN3_MOE, "model_type": "kimi_linear"})
    with pytest.raises(ValueError, match="model_type=None"):
        parse_model_config({k: v for k, v in QWEN3_MOE.items() if k != "model_type"})


@pytest.mark.parametrize(
    "field", ["vocab_size", "hidden_size", "num_hidden_layers", "moe_intermediate_size", "num_experts"]
)
def test_missing_required_field_is_named(field):
    with pytest.raises(ValueError, match=f"missing the required field '{field}'"):
        parse_model_config({k: v for k, v in QWEN3_MOE.items() if k != field})


@pytest.mark.parametrize(
    ("field", "value"), [("hidden_size", 0), ("hidden_size", "32"), ("num_experts_per_tok", True), ("rms_norm_eps", -1)]
)
def test_invalid_field_is_named_with_its_value(field, value):
    with pytest.raises(ValueError, match=f"'{field}' must be a positive"):
        parse_model_config({**QWEN3_MOE, field: value})


def test_shape_rules():
    with pytest.raises(ValueError, match="num_attention_heads=4 must be a multiple of num_key_value_heads=3"):
        parse_model_config({**QWEN3_MOE, "num_key_value_heads": 3})
    with pytest.raises(ValueError, match="num_experts_per_tok=9 exceeds num_experts=8"):
        parse_model_config({**QWEN3_MOE, "num_experts_per_tok": 9})
    with pytest.raises(ValueError, match=r"mlp_only_layers=\[4\] must list layer indices in \[0, 4\)"):
        parse_model_config({**QWEN3_MOE, "mlp_only_layers": [4]})


def test_a_pad_token_outside_the_vocabulary_is_refused():
    with pytest.raises(ValueError, match=r"pad_token_id=8 must be a token id below vocab_size=8"):
        parse_model_config({**QWEN3_MOE, "vocab_size": 8, "pad_token_id": 8})


def test_the_load_balancing_convention_is_read():
    moe = parse_model_config({**QWEN3_MOE, "output_router_logits": True, "router_aux_loss_coef": 0.02}).moe
    assert moe.output_router_logits and moe.router_aux_loss_coef == 0.02
    assert parse_model_config(QWEN3_MOE).moe.router_aux_loss_coef == 0.001  # transformers' default
    with pytest.raises(ValueError, match=r"'router_aux_loss_coef' must be a number >= 0, got -1"):
        parse_model_config({**QWEN3_MOE, "router_aux_loss_coef": -1})


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"use_sliding_window": True}, "sliding-window attention is not implemented"),
        ({"hidden_act": "gelu"}, "only 'silu' is implemented"),
        ({"attention_dropout": 0.1}, "attention dropout is not implemented"),
        (
            {"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}},
            "rope_type='dynamic' is not implemented.*default, linear, llama3, yarn",
        ),
    ],
)
def test_unimplemented_features_are_refused(override, message):
    with pytest.raises(ValueError, match=message):
        parse_model_config({**QWEN3_MOE, **override})


def test_defaults_follow_transformers():
    config = parse_model_config(QWEN3_MOE)
    assert config.head_dim == 8 and config.rms_norm_eps == 1e-6 and config.rope.theta == 10_000.0
    assert not config.tie_word_embeddings and config.qk_norm
    assert config.moe is not None and config.moe.decoder_sparse_step == 1 and not config.moe.norm_topk_prob
    qwen3 = parse_model_config({**LLAMA, "model_type": "qwen3"})
    assert qwen3.head_dim == 128 and qwen3.qk_norm  # Qwen3Config's own default head_dim
    assert not parse_model_config(LLAMA).qk_norm


def test_transformers_spelling_of_num_experts():
    raw = {k: v for k, v in QWEN3_MOE.items() if k != "num_experts"} | {"num_local_experts": 6}
    config = parse_model_config(raw)
    assert config.moe is not None and config.moe.num_experts == 6


def test_sparse_layers_follow_step_and_mlp_only_layers():
    config = parse_model_config({**QWEN3_MOE, "decoder_sparse_step": 2, "mlp_only_layers": [3]})
    assert [config.layer_is_sparse(i) for i in range(4)] == [False, True, False, False]


@pytest.mark.parametrize(
    "rope_fields",
    [
        {
            "rope_theta": 5e5,
            "rope_scaling": {
                "type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        },
        {
            "rope_parameters": {
                "rope_theta": 5e5,
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            }
        },
    ],
)
def test_rope_in_legacy_and_transformers5_spelling(rope_fields):
    rope = parse_model_config({**LLAMA, **rope_fields}).rope
    assert (rope.kind, rope.theta, rope.factor, rope.original_max_position_embeddings) == ("llama3", 5e5, 8.0, 8192)


GPT_OSS_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
    "rope_theta": 150000.0,
}


def test_yarn_rope_is_read():
    rope = parse_model_config({**LLAMA, "max_position_embeddings": 131072, "rope_parameters": GPT_OSS_ROPE}).rope
    assert rope == RopeConfig(
        theta=150000.0,
        kind="yarn",
        factor=32.0,
        original_max_position_embeddings=4096,
        beta_fast=32.0,
        beta_slow=1.0,
        truncate=False,
    )
    deepseek = {"type": "yarn", "factor": 40, "mscale": 0.707, "mscale_all_dim": 0, "attention_factor": 1.5}
    rope = parse_model_config({**LLAMA, "rope_theta": 1e4, "rope_scaling": deepseek}).rope
    assert (rope.factor, rope.mscale, rope.mscale_all_dim, rope.attention_factor) == (40.0, 0.707, 0.0, 1.5)


def test_yarn_defaults_follow_transformers():
    # Absent or null optional fields: beta 32/1, truncate on, attention factor derived from factor.
    nulls = {"beta_fast": None, "beta_slow": None, "attention_factor": None, "mscale": None}
    for extra in ({}, nulls):
        rope = parse_model_config({**LLAMA, "rope_scaling": {"rope_type": "yarn", "factor": 4.0, **extra}}).rope
        assert (rope.beta_fast, rope.beta_slow, rope.truncate) == (32.0, 1.0, True)
        assert rope.attention_factor is None and rope.mscale is None and rope.mscale_all_dim is None
        # The pretraining context defaults to max_position_embeddings (LlamaConfig's default 2048).
        assert rope.original_max_position_embeddings == 2048


def test_yarn_context_and_factor_sources():
    base = {**LLAMA, "max_position_embeddings": 8192}
    # A top-level original_max_position_embeddings wins over the rope dict's (as transformers' rotary init).
    rope = parse_model_config(
        {
            **base,
            "original_max_position_embeddings": 1024,
            "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048},
        }
    ).rope
    assert rope.original_max_position_embeddings == 1024
    # A null factor is the ratio of the extended to the pretraining context.
    yarn = {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 2048}
    rope = parse_model_config({**base, "rope_scaling": yarn}).rope
    assert rope.factor == 4.0


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"factor": 0}, r"'factor' must be a positive number, got 0"),
        ({"factor": "4"}, r"'factor' must be a positive number, got '4'"),
        ({"factor": 0.5}, r"'factor' must be >= 1, got 0.5 from the rope dict"),
        (
            {"factor": None, "original_max_position_embeddings": 4096},
            r"'factor' must be >= 1, got 0.5 from max_position_embeddings / original_max_position_embeddings "
            r"= 2048 / 4096",
        ),
        ({"original_max_position_embeddings": 4096.0}, r"'original_max_position_embeddings' must be .*got 4096.0"),
        ({"original_max_position_embeddings": 0}, r"'original_max_position_embeddings' must be a positive .*got 0"),
        ({"beta_fast": -1}, r"'beta_fast' must be a positive number, got -1"),
        ({"beta_slow": 0}, r"'beta_slow' must be a positive number, got 0"),
        ({"beta_fast": 1, "beta_slow": 2}, r"needs beta_fast >= beta_slow, got beta_fast=1.0, beta_slow=2.0"),
        ({"truncate": "no"}, r"'truncate' must be true or false, got 'no'"),
        ({"truncate": None}, r"'truncate' must be true or false, got None"),
        ({"attention_factor": 0.0}, r"'attention_factor' must be a positive number, got 0.0"),
        ({"mscale": -0.5}, r"'mscale' must be a number >= 0, got -0.5"),
        ({"mscale_all_dim": float("nan")}, r"'mscale_all_dim' must be a number >= 0, got nan"),
    ],
)
def test_invalid_yarn_fields_are_named(override, message):
    yarn = {"rope_type": "yarn", "factor": 4.0, **override}
    with pytest.raises(ValueError, match=r"config\.json rope yarn scaling .*" + message):
        parse_model_config({**LLAMA, "rope_scaling": yarn})


def test_load_model_config_reads_the_directory(tmp_path):
    with pytest.raises(ValueError, match=r"no config\.json"):
        load_model_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_MOE))
    config = load_model_config(tmp_path)
    assert config.model_type == "qwen3_moe" and config.raw == QWEN3_MOE
