"""raymoe's Qwen3-MoE under its own default tp_plan (resolve_plans -> apply_rules), tp=2, against one process.

A tiny model with GQA, q/k norms, one sparse and one dense layer and a padding token: the logits
must match (max abs diff <= 1e-5) and, after one backward, so must every parameter's gathered
gradient (relative diff <= 1e-5), the router's included.
"""

from __future__ import annotations

import torch

TINY_QWEN3_MOE = {
    "model_type": "qwen3_moe",
    "vocab_size": 64,
    "hidden_size": 16,
    "intermediate_size": 24,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 8,
    "norm_topk_prob": True,
    "mlp_only_layers": [1],
    "max_position_embeddings": 64,
    "pad_token_id": 3,
}


def check_default_tp_plan(rank):
    from raymoe import DistributedConfig
    from raymoe.models import build_model, parse_model_config
    from raymoe.spec.plans import resolve_plans

    config = parse_model_config(TINY_QWEN3_MOE)
    plans = resolve_plans(
        build_model(config),  # on meta, as the driver does
        build_model(config).default_plans(),
        DistributedConfig(tp_size=rank.world_size, fsdp_size=1),
        num_experts=config.moe.num_experts,
    )
    assert plans.tp_rules["model.layers.0.mlp.experts"] == "moe_tp_experts"
    assert plans.tp_rules["model.layers.1.mlp.down_proj"] == "rowwise"
    torch.manual_seed(0)
    full = build_model(config, device="cpu")
    sharded = rank.sharded_twin(full, plans.tp_rules)
    ids = torch.randint(0, config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(1))
    ids[0, -2:] = config.pad_token_id
    want, got = full(ids), sharded(ids)
    rank.expect_close("logits", got, want)
    probe = torch.randn(want.shape, generator=torch.Generator().manual_seed(7))
    (want * probe).sum().backward()
    (got * probe).sum().backward()
    rank.expect_same_grads(sharded, full)
    with torch.no_grad():
        rank.expect_close("no_grad logits", sharded(ids), full(ids))


def test_qwen3_moe_default_tp_plan_matches_one_process(tp2):
    tp2.run(check_default_tp_plan)
