"""Context and sequence parallelism on the driver (issue 32): what a layout needs of the model and of the rows is one
clear ValueError before any actor starts, and the topology draws the cp axis."""

from __future__ import annotations

import pytest

from raymoe import DistributedConfig
from raymoe.spec.launch import prepare_launch
from raymoe.spec.plans import resolve_plans
from raymoe.spec.topology import Axis, build_topology

QWEN = "moe_e8_k2_mha"  # 4 heads


@pytest.mark.parametrize(
    ("layout", "message"),
    [
        ({"cp_size": 8, "cp_mode": "all_to_all"}, r"4 query heads per tp rank, which do not split over cp_size=8"),
        ({"cp_size": 4, "tp_size": 2, "cp_mode": "all_to_all"}, r"2 query heads per tp rank.*cp_size=4.*'ring'"),
    ],
)
def test_all_to_all_needs_heads_that_split_over_the_cp_ranks(tiny_checkpoint, layout, message):
    with pytest.raises(ValueError, match=message):
        prepare_launch(tiny_checkpoint(QWEN), layout)
    ring = prepare_launch(tiny_checkpoint(QWEN), {**layout, "cp_mode": "ring"})  # the ring takes any head count
    assert ring.topology.config.cp_size == layout["cp_size"]


def test_sequence_parallelism_adds_norm_rules_to_the_tp_plan(tiny_checkpoint):
    spec = prepare_launch(tiny_checkpoint(QWEN), {"tp_size": 2, "enable_sequence_parallel": True})
    rules = spec.plans.tp_rules
    for path in ("model.layers.0.input_layernorm", "model.layers.1.post_attention_layernorm", "model.norm"):
        assert rules[path] == "sequence_parallel", path
    plain = prepare_launch(tiny_checkpoint(QWEN), {"tp_size": 2})
    assert "model.norm" not in plain.plans.tp_rules


def test_a_user_plan_for_a_norm_wins_over_the_sequence_parallel_default(tiny_checkpoint):
    from raymoe.models.registry import build_model

    spec = prepare_launch(tiny_checkpoint(QWEN), {"tp_size": 2})
    model = build_model(spec.config, device="meta")
    config = DistributedConfig(
        tp_size=2, enable_sequence_parallel=True, tp_plan={"model.norm": "replicated_with_grad_allreduce"}
    )
    plans = resolve_plans(model, model.default_plans(), config.resolve(2), num_experts=model.num_experts)
    assert plans.tp_rules["model.norm"] == "replicated_with_grad_allreduce"


@pytest.mark.parametrize(
    ("layout", "length", "message"),
    [
        ({"cp_size": 2}, 10, r"sequence of 10 tokens does not split over cp_size=2.*multiple of 4"),
        ({"cp_size": 4}, 20, r"multiple of 8"),
        ({"tp_size": 2, "enable_sequence_parallel": True}, 9, r"9 tokens does not split over tp_size=2.*\[CFG-9\]"),
        (
            {"cp_size": 2, "tp_size": 4, "enable_sequence_parallel": True},
            20,
            r"20 tokens \(each cp rank's share of 10\) does not split over tp_size=4",
        ),
    ],
)
def test_a_length_the_layout_cannot_split_is_one_clear_error(layout, length, message):
    with pytest.raises(ValueError, match=message):
        DistributedConfig(**layout).check_sequence_length(length)


@pytest.mark.parametrize(
    ("layout", "length"),
    [({"cp_size": 2}, 12), ({"cp_size": 4}, 24), ({"cp_size": 2, "tp_size": 2, "enable_sequence_parallel": True}, 8)],
)
def test_lengths_that_split_pass(layout, length):
    DistributedConfig(**layout).check_sequence_length(length)
    DistributedConfig(fsdp_size=2).check_sequence_length(7)  # nothing to split


def test_sequence_parallelism_with_pipelines_is_refused():
    with pytest.raises(ValueError, match=r"enable_sequence_parallel=True with pp_size=2 is not implemented.*\[CFG-9\]"):
        DistributedConfig(tp_size=2, pp_size=2, enable_sequence_parallel=True)


def test_the_cp_axis_groups_the_ranks_that_share_a_batch():
    topology = build_topology(DistributedConfig(fsdp_size=2, cp_size=2, tp_size=2, ep_size=4))
    assert [r.cp for r in topology.ranks] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert [r.batch for r in topology.ranks] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert topology.groups(Axis.CP) == ((0, 2), (1, 3), (4, 6), (5, 7))
    assert topology.groups(Axis.EP) == ((0, 1, 2, 3), (4, 5, 6, 7))  # expert parallelism spans the cp ranks
    assert topology.answer_ranks() == (0, 4)
    assert [topology.answers(r) for r in range(8)] == [True, False, False, False, True, False, False, False]
    picture = topology.describe(num_experts=8)
    assert "cp group of 2 TP groups" in picture and "c0c3" in picture and "c1c2" in picture
