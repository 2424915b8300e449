"""Vocabulary-parallel loss: under TP the head's logits stay sharded, the loss and every gradient equal one process."""

from __future__ import annotations

import torch

MOE = "moe_e8_k2_mha"  # a conftest tiny checkpoint: vocabulary 96, 4 heads, 8 experts


def twins(rank, directory, tp_rules=None):
    import json
    from pathlib import Path

    from raymoe import DistributedConfig
    from raymoe.models import build_model, parse_model_config
    from raymoe.spec.plans import resolve_plans

    config = parse_model_config(json.loads((Path(directory) / "config.json").read_text()))
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


def check_loss_and_gradients_without_gathered_logits(rank, directory):
    from torch.distributed.tensor import DTensor, Shard

    from raymoe.models import causal_lm_loss
    from raymoe.parallel.vocab_parallel import vocab_parallel_loss, whole

    full, sharded, ids, labels = twins(rank, directory)
    want = causal_lm_loss(full(ids), labels, reduction="sum")
    want.backward()
    with vocab_parallel_loss(sharded):
        logits = sharded(ids)
        assert isinstance(logits, DTensor) and logits.placements == (Shard(2),), logits.placements  # [B, S, V/tp]
        assert logits.to_local().shape[-1] == 96 // rank.world_size  # each rank holds only its vocabulary part
        got = whole(causal_lm_loss(logits, labels, reduction="sum"))
        got.backward()
    assert not isinstance(got, DTensor)
    rank.expect_close_rel("loss", got, want)
    rank.expect_same_grads(sharded, full)
    # outside the block the head gathers again: inference and generation see whole logits
    after = sharded(ids)
    assert not isinstance(after, DTensor) and after.shape[-1] == 96


def check_other_heads_are_left_alone(rank, directory):
    from torch.distributed.tensor import DTensor

    from raymoe.parallel.vocab_parallel import vocab_parallel_loss

    attention_only = {
        "model.layers.0.self_attn.q_proj": "colwise",
        "model.layers.0.self_attn.k_proj": "colwise",
        "model.layers.0.self_attn.v_proj": "colwise",
        "model.layers.0.self_attn.o_proj": "rowwise",
    }
    _, sharded, ids, _ = twins(rank, directory, tp_rules=attention_only)
    with vocab_parallel_loss(sharded):
        logits = sharded(ids)
    assert not isinstance(logits, DTensor) and logits.shape[-1] == 96


def test_vocab_parallel_loss_equals_one_process(tp2, tiny_checkpoint):
    tp2.run(check_loss_and_gradients_without_gathered_logits, str(tiny_checkpoint(MOE)))


def test_vocab_parallel_loss_leaves_a_head_without_tp_alone(tp2, tiny_checkpoint):
    tp2.run(check_other_heads_are_left_alone, str(tiny_checkpoint(MOE)))
