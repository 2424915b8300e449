"""Construction on meta, hub names, and default plans that resolve against the real modules."""

from __future__ import annotations

import logging

import pytest
import torch

from raymoe import DistributedConfig
from raymoe.models import build_model, parse_model_config
from raymoe.spec.plans import resolve_plans


def _meta_model(make_hf_model, name):
    return build_model(parse_model_config(make_hf_model(name).config.to_dict()))


def test_meta_model_matches_transformers_names_and_shapes(tiny_name, make_hf_model, in_raymoe_layout):
    reference = make_hf_model(tiny_name)
    model = _meta_model(make_hf_model, tiny_name)
    assert all(p.is_meta for p in model.parameters())
    ours = {name: tuple(p.shape) for name, p in model.state_dict().items()}
    theirs = {
        name: tuple(in_raymoe_layout(model.model_type, name, p).shape) for name, p in reference.state_dict().items()
    }
    assert ours == theirs
    assert model.base_model_prefix == "model"


def test_tied_head_shares_the_embedding(make_hf_model):
    model = _meta_model(make_hf_model, "qwen3_gqa4_tied")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert "lm_head.weight" not in dict(model.named_parameters())


@pytest.mark.parametrize("tp_size, ep_size", [(2, 2), (2, 1), (1, 1)])
def test_default_plans_match_real_modules(tiny_name, make_hf_model, caplog, tp_size, ep_size):
    model = _meta_model(make_hf_model, tiny_name)
    plans = model.default_plans()
    if model.num_experts is None or model.num_experts % ep_size:
        ep_size = 1  # dense, or 5 experts: CFG-3 forbids ep_size=2
    if model.config.num_key_value_heads % tp_size:
        tp_size = ep_size  # one kv head (qwen3_gqa4_tied): the built-in styles refuse to split a head
    config = DistributedConfig(tp_size=tp_size, ep_size=ep_size, fsdp_size=1)
    with caplog.at_level(logging.WARNING, logger="raymoe.spec.plans"):
        resolved = resolve_plans(model, plans, config, num_experts=model.num_experts)  # the built-in styles
    assert not [r for r in caplog.records if "matched nothing" in r.getMessage()]
    assert all(key.startswith(("model.", "lm_head")) for plan in (plans.tp, plans.ep, plans.fsdp) for key in plan)
    if tp_size > 1:
        query = "q_b_proj" if "model.layers.0.self_attn.q_b_proj" in resolved.tp_rules else "q_proj"  # MLA's rank
        assert resolved.tp_rules[f"model.layers.0.self_attn.{query}"] == "colwise"
    if ep_size > 1:
        assert resolved.expert_mode == "dispatch"
        first_sparse = model.sparse_layers()[0]
        assert resolved.ep_rules[f"model.layers.{first_sparse}.mlp.experts"] == "ep_dispatch_experts"


def test_qwen3_moe_plans(make_hf_model):
    model = _meta_model(make_hf_model, "moe_e5_k3_gqa2_dense_mid")
    plans = model.default_plans()
    assert model.num_experts == 5 and model.supports_tp_plan
    assert plans.ep == {
        "model.layers.*.mlp.experts.gate_up_proj": "grouped_gemm",
        "model.layers.*.mlp.experts.down_proj": "grouped_gemm",
        "model.layers.*.mlp.experts": "ep_dispatch_experts",
    }
    assert plans.tp["model.layers.*.mlp.experts.gate_up_proj"] == "packed_colwise"
    assert plans.tp["model.layers.*.mlp.gate_proj"] == "colwise"  # layer 1 is dense
    assert plans.tp["model.layers.*.self_attn.q_norm"] == "replicated_with_grad_allreduce"
    assert plans.fsdp == {
        "model.embed_tokens": "free_full_weight",
        "model.layers.*": "free_full_weight",
        "model.norm": "keep_full_weight",
        "lm_head": "keep_full_weight",
    }


def test_all_sparse_model_has_no_dense_mlp_rules():
    raw = {
        "model_type": "qwen3_moe",
        "vocab_size": 16,
        "hidden_size": 8,
        "intermediate_size": 8,
        "moe_intermediate_size": 4,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_experts": 4,
        "num_experts_per_tok": 2,
    }
    plans = build_model(parse_model_config(raw)).default_plans()
    assert "model.layers.*.mlp.gate_proj" not in plans.tp and "model.layers.*.mlp.experts" in plans.tp


def test_dense_plans(make_hf_model):
    llama = _meta_model(make_hf_model, "llama_gqa2_llama3_rope_bias")
    assert llama.num_experts is None and llama.default_plans().ep == {}
    assert "model.layers.*.self_attn.q_norm" not in llama.default_plans().tp
    qwen3 = _meta_model(make_hf_model, "qwen3_gqa4_tied")
    assert "model.layers.*.self_attn.q_norm" in qwen3.default_plans().tp
    # tied: the embedding is wrapped once and keeps its gathered weight for the head
    assert qwen3.default_plans().fsdp == {
        "model.embed_tokens": "keep_full_weight",
        "model.layers.*": "free_full_weight",
        "model.norm": "keep_full_weight",
    }


def test_build_on_cpu_initialises_every_parameter(make_hf_model):
    config = parse_model_config(make_hf_model("moe_e5_k3_gqa2_dense_mid").config.to_dict())
    model = build_model(config, device="cpu", dtype=torch.bfloat16)
    for name, param in model.named_parameters():
        assert param.dtype == torch.bfloat16 and torch.isfinite(param).all(), name
        if name.endswith("norm.weight"):
            assert torch.equal(param, torch.ones_like(param))
        else:
            assert 0.005 < param.float().std() < 0.05, name
    assert model(torch.tensor([[1, 2, 3]])).shape == (1, 3, config.vocab_size)
