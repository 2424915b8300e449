"""gpt-oss and Mixtral beyond the shared parity tests: MXFP4 checkpoints, both Mixtral hub layouts, long prompts
through sliding windows, default plans against transformers' own, and the config fields only they have."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from raymoe.checkpoint import load_model, save_model
from raymoe.models import parse_model_config
from raymoe.models.common.generation import generate

GPT_OSS = "gptoss_e4_k3_gqa2_window5"
MIXTRAL = "mixtral_e8_k3_gqa2_window6"


def _ids(vocab: int, batch: int = 2, seq: int = 11, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


# --- MXFP4 ------------------------------------------------------------------------------------


def test_mxfp4_checkpoint_loads_the_known_weights_as_transformers_does(
    gpt_oss_mxfp4_checkpoint, load_hf_model, in_raymoe_layout
):
    plain, quantized = gpt_oss_mxfp4_checkpoint
    with safe_open(quantized / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert "model.layers.0.mlp.experts.gate_up_proj_blocks" in keys
    assert "model.layers.0.mlp.experts.gate_up_proj" not in keys
    ours = load_model(quantized, dtype=torch.float32)
    known = load_model(plain)
    reference = load_hf_model(quantized)  # transformers dequantizes on CPU
    reference_params = dict(reference.named_parameters())
    for name, param in ours.named_parameters():
        # the weights quantized in the test come back exactly, as they do in transformers
        assert torch.equal(param, dict(known.named_parameters())[name]), name
        assert torch.equal(param, in_raymoe_layout("gpt_oss", name, reference_params[name].detach())), name
    ids = _ids(ours.config.vocab_size)
    with torch.no_grad():
        expected = reference(input_ids=ids).logits
        assert (ours(ids) - expected).abs().max().item() <= 1e-5
    assert expected.std().item() > 1e-2


def test_mxfp4_checkpoint_saves_plain_tensors_transformers_loads(gpt_oss_mxfp4_checkpoint, load_hf_model, tmp_path):
    _, quantized = gpt_oss_mxfp4_checkpoint
    ours = load_model(quantized, dtype=torch.float32)
    save_model(ours, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert "quantization_config" not in config
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        assert not any(key.endswith(("_blocks", "_scales")) for key in set(f.keys()))
        assert f.get_slice("model.layers.0.mlp.experts.gate_up_proj").get_shape() == [4, 64, 64]  # [E, H, 2I]
    reloaded = load_hf_model(tmp_path)
    ids = _ids(ours.config.vocab_size)
    with torch.no_grad():
        assert (ours(ids) - reloaded(input_ids=ids).logits).abs().max().item() <= 1e-5


# --- Mixtral's two hub layouts ----------------------------------------------------------------


def test_mixtral_reads_the_fused_layout_too(tiny_checkpoint, make_hf_model, tmp_path):
    original = tiny_checkpoint(MIXTRAL)
    with safe_open(original / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert "model.layers.0.block_sparse_moe.experts.0.w1.weight" in keys  # what transformers writes
    # transformers' in-memory names: mlp.gate, mlp.experts.gate_up_proj [E, 2I, H], mlp.experts.down_proj
    fused = {name: t.contiguous() for name, t in make_hf_model(MIXTRAL).state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in fused
    save_file(fused, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((original / "config.json").read_text())
    from_fused, from_original = load_model(tmp_path), load_model(original)
    for (name, a), (_, b) in zip(from_fused.named_parameters(), from_original.named_parameters(), strict=True):
        assert torch.equal(a, b), name


# --- sliding windows in generation -------------------------------------------------------------


@pytest.mark.parametrize("name", [GPT_OSS, MIXTRAL])
def test_generation_from_a_prompt_longer_than_the_window(name, tiny_checkpoint, load_hf_model):
    directory = tiny_checkpoint(name)
    ours, reference = load_model(directory), load_hf_model(directory)
    window = ours.config.sliding_window
    prompts = _ids(ours.config.vocab_size, seq=window + 4, seed=5)
    expected = reference.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=10, do_sample=False)
    assert torch.equal(generate(ours, prompts, max_new_tokens=10), expected)


def test_the_window_changes_the_output(tiny_checkpoint):
    """A model with the window removed differs past the window: the tests above see the window at work."""
    model = load_model(tiny_checkpoint(GPT_OSS))
    ids = _ids(model.config.vocab_size, seq=12)
    with torch.no_grad():
        windowed = model(ids)
        for layer in model.model.layers:
            layer.self_attn.sliding_window = None
        full = model(ids)
    window = model.config.sliding_window
    assert torch.allclose(windowed[:, :window], full[:, :window], atol=1e-6)
    assert (windowed[:, window:] - full[:, window:]).abs().max().item() > 1e-4


# --- default plans against transformers' config plans -------------------------------------------


@pytest.mark.parametrize("name", [GPT_OSS, MIXTRAL])
def test_default_plans_extend_transformers_plans(name, make_hf_model):
    reference = make_hf_model(name).config
    model = load_model_meta(make_hf_model, name)
    plans = model.default_plans()
    prefixed = {f"model.{key}": style for key, style in reference.base_model_ep_plan.items()}
    assert dict(plans.ep) == prefixed
    for key, style in (reference.base_model_tp_plan or {}).items():
        assert plans.tp[f"model.{key}"] == style
    assert plans.tp["lm_head"] == "colwise_gather_output"


def load_model_meta(make_hf_model, name):
    from raymoe.models import build_model

    return build_model(parse_model_config(make_hf_model(name).config.to_dict()))


def test_gpt_oss_tp_plan_shards_sinks_with_their_heads(make_hf_model):
    plans = load_model_meta(make_hf_model, GPT_OSS).default_plans()
    assert plans.tp["model.layers.*.self_attn.sinks"] == "colwise"
    assert plans.tp["model.layers.*.self_attn"] == "local_params"
    assert plans.tp["model.layers.*.mlp.experts"] == "moe_tp_experts"


# --- config fields only these families have ------------------------------------------------------

GPT_OSS_CONFIG = {
    "model_type": "gpt_oss",
    "vocab_size": 96,
    "hidden_size": 40,
    "intermediate_size": 12,
    "num_hidden_layers": 3,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
}


def test_gpt_oss_defaults_are_transformers():
    config = parse_model_config(GPT_OSS_CONFIG)
    assert config.head_dim == 64 and config.rms_norm_eps == 1e-5 and config.attention_bias
    assert config.layer_types == ("sliding_attention", "full_attention", "sliding_attention")
    assert config.sliding_window == 128 and config.attention_sinks
    assert config.rope.kind == "yarn" and config.rope.theta == 150000.0 and config.rope.factor == 32.0
    assert config.moe is not None and config.moe.norm_topk_prob and config.moe.router_bias and config.moe.expert_bias
    assert config.moe.moe_intermediate_size == 12
    assert config.moe.activation.interleaved and config.moe.activation.clamp_limit == 7.0
    assert config.moe.activation.alpha == 1.702


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"quantization_config": {"quant_method": "fp8"}}, r"quant_method='fp8'.*mxfp4 or unquantized"),
        ({"layer_types": ["full_attention"]}, r"'layer_types' must list one of .* each of the 3 layers"),
        ({"layer_types": ["sliding_attention", "full_attention", "chunked"]}, r"'layer_types'"),
        ({"sliding_window": None}, r"sliding_attention layers but sliding_window is null"),
        ({"sliding_window": 0}, r"'sliding_window' must be a positive integer or null, got 0"),
        ({"swiglu_limit": -1.0}, r"'swiglu_limit' must be a positive number, got -1.0"),
    ],
)
def test_gpt_oss_config_errors_name_the_field(edit, message):
    with pytest.raises(ValueError, match=message):
        parse_model_config({**GPT_OSS_CONFIG, **edit})


def test_mixtral_defaults_and_errors():
    base = {**GPT_OSS_CONFIG, "model_type": "mixtral", "head_dim": 6}
    config = parse_model_config(base)
    assert config.rope.theta == 1e6 and config.rms_norm_eps == 1e-5 and config.sliding_window is None
    assert config.layer_types == () and config.moe is not None and config.moe.norm_topk_prob
    windowed = parse_model_config({**base, "sliding_window": 7})
    assert windowed.layer_types == ("sliding_attention",) * 3 and windowed.sliding_window == 7
    with pytest.raises(ValueError, match=r"router_jitter_noise=0.1: router jitter .* not implemented"):
        parse_model_config({**base, "router_jitter_noise": 0.1})
