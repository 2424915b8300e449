"""Vocabulary-parallel loss: under TP the head's logits stay sharded, the loss and every gradient equal one process."""

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
    "mlp_only_layers": [1],
    "max_position_embeddings": 64,
}


def twins(rank, tp_rules=None):
    from raymoe import DistributedConfig
    from raymoe.models import build_model, parse_model_config
    from raymoe.plans import resolve_plans

    config = parse_model_config(TINY_QWEN3_MOE)
    if tp_rules is None:
        plans = resolve_plans(
            build_model(config),
            build_model(config).default_plans(),
            DistributedConfig(tp_size=rank.world_size, fsdp_size=1),
            num_experts=config.moe.num_experts,
        )
        tp_rules = plans.tp_rules
    torch.manual_seed(0)
    full = build_model(config, device="cpu")
    ids = torch.randint(0, config.vocab_size, (3, 9), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[1, :4] = -100  # ignored tokens take no loss
    return full, rank.sharded_twin(full, tp_rules), ids, labels


def check_loss_and_gradients_without_gathered_logits(rank):
    from torch.distributed.tensor import DTensor, Shard

    from raymoe.models import causal_lm_loss
    from raymoe.vocab_parallel import vocab_parallel_loss, whole

    full, sharded, ids, labels = twins(rank)
    want = causal_lm_loss(full(ids), labels, reduction="sum")
    want.backward()
    with vocab_parallel_loss(sharded):
        logits = sharded(ids)
        assert isinstance(logits, DTensor) and logits.placements == (Shard(2),), logits.placements  # [B, S, V/tp]
        assert logits.to_local().shape[-1] == 64 // rank.world_size  # each rank holds only its vocabulary part
        got = whole(causal_lm_loss(logits, labels, reduction="sum"))
        got.backward()
    assert not isinstance(got, DTensor)
    rank.expect_close_rel("loss", got, want)
    rank.expect_same_grads(sharded, full)
    # outside the block the head gathers again: inference and generation see whole logits
    after = sharded(ids)
    assert not isinstance(after, DTensor) and after.shape[-1] == 64


def check_other_heads_are_left_alone(rank):
    from torch.distributed.tensor import DTensor

    from raymoe.vocab_parallel import vocab_parallel_loss

    dense_mlp_only = {
        "model.layers.1.mlp.gate_proj": "colwise",
        "model.layers.1.mlp.up_proj": "colwise",
        "model.layers.1.mlp.down_proj": "rowwise",
    }
    _, sharded, ids, _ = twins(rank, tp_rules=dense_mlp_only)
    with vocab_parallel_loss(sharded):
        logits = sharded(ids)
    assert not isinstance(logits, DTensor) and logits.shape[-1] == 64


def test_vocab_parallel_loss_equals_one_process(tp2):
    tp2.run(check_loss_and_gradients_without_gathered_logits)


def test_vocab_parallel_loss_leaves_a_head_without_tp_alone(tp2):
    tp2.run(check_other_heads_are_left_alone)
