"""Topology: coordinates and groups of every rank (TOPO-1…TOPO-5), and the rank picture."""

import itertools
import re
from pathlib import Path

import pytest

from raymoe import DistributedConfig, build_topology
from raymoe.spec.topology import DENSE_AXES, EXPERT_AXES, Axis

SPEC = Path(__file__).resolve().parents[3] / "shared" / "SPEC.md"

# The TOPO-3 picture, as SPEC §2 draws it.
TOPO3 = """\
rank         0      1       2      3       4      5       6      7
batch       [====B0====]   [====B1====]   [====B2====]   [====B3====]     one batch per TP pair
tp           0      1       0      1       0      1       0      1
ep_size=2   E0-3   E4-7    E0-3   E4-7    E0-3   E4-7    E0-3   E4-7     group = a TP pair,   efsdp_size=4
ep_size=4   E0E1   E2E3    E4E5   E6E7    E0E1   E2E3    E4E5   E6E7     group = two pairs,   efsdp_size=2
ep_size=8   E0     E1      E2     E3      E4     E5      E6     E7       group = all ranks,   efsdp_size=1"""

LAYOUTS = [
    {"tp_size": 2, "fsdp_size": 4, "ep_size": 2},
    {"tp_size": 2, "fsdp_size": 4, "ep_size": 4},
    {"tp_size": 2, "fsdp_size": 4, "ep_size": 8},
    {"tp_size": 1, "fsdp_size": 8, "ep_size": 4},
    {"tp_size": 4, "fsdp_size": 2, "ep_size": 4},
    {"dp_replicate_size": 2, "fsdp_size": 2, "ep_size": 2},
    {"dp_replicate_size": 2, "fsdp_size": 2, "tp_size": 2, "ep_size": 4},
    {"tp_size": 4},
    {"fsdp_size": 3},
]


def topo(**kwargs):
    return build_topology(DistributedConfig(**kwargs))


def test_describe_reproduces_spec_topo3_exactly():
    picture = topo(tp_size=2, fsdp_size=4).describe(num_experts=8, ep_sizes=(2, 4, 8))
    assert picture == TOPO3


@pytest.mark.skipif(not SPEC.exists(), reason="shared/SPEC.md is not beside this checkout")
def test_topo3_constant_is_the_spec_picture():
    assert TOPO3 in SPEC.read_text()


@pytest.mark.parametrize("kwargs", LAYOUTS)
def test_groups_partition_the_world_with_axis_sizes(kwargs):
    t = topo(**kwargs)
    for axis in Axis:
        groups = t.groups(axis)
        assert sorted(itertools.chain(*groups)) == list(range(t.world_size))
        assert {len(g) for g in groups} == {t.axis_size(axis)}


@pytest.mark.parametrize("kwargs", LAYOUTS)
def test_both_views_are_row_major_with_tp_and_ep_innermost(kwargs):
    t = topo(**kwargs)
    fsdp, tp = t.axis_size(Axis.FSDP), t.axis_size(Axis.TP)
    efsdp, ep = t.axis_size(Axis.EFSDP), t.axis_size(Axis.EP)
    for r in t.ranks:
        assert r.rank == (r.dp_replicate * fsdp + r.fsdp) * tp + r.tp
        assert r.rank == (r.dp_replicate * efsdp + r.efsdp) * ep + r.ep
        for axis in Axis:
            assert r.rank in t.group_of(r.rank, axis)
            members = [t.ranks[m] for m in t.group_of(r.rank, axis)]
            assert sorted(m.on(axis) for m in members) == list(range(t.axis_size(axis)))
            view = DENSE_AXES if axis in DENSE_AXES else EXPERT_AXES
            for other in view:
                if other != axis:
                    assert {m.on(other) for m in members} == {r.on(other)}


@pytest.mark.parametrize("kwargs", LAYOUTS)
def test_topo1_tp_groups_are_consecutive_and_share_a_batch(kwargs):
    t = topo(**kwargs)
    tp = t.axis_size(Axis.TP)
    for group in t.groups(Axis.TP):
        assert list(group) == list(range(group[0], group[0] + tp))
        assert len({t.ranks[r].batch for r in group}) == 1
    # the batch depends only on (dp_replicate, fsdp), and there are dp_size of them
    for r in t.ranks:
        assert r.batch == r.dp_replicate * t.axis_size(Axis.FSDP) + r.fsdp
    assert len({r.batch for r in t.ranks}) == t.config.dp_size
    assert t.batch_ranks() == t.groups(Axis.TP)


@pytest.mark.parametrize("kwargs", LAYOUTS)
def test_topo2_ep_groups_hold_one_full_expert_set(kwargs):
    t = topo(**kwargs)
    ep = t.axis_size(Axis.EP)
    num_experts = 8 * ep
    for group in t.groups(Axis.EP):
        assert list(group) == list(range(group[0], group[0] + ep))
        experts = sorted(itertools.chain(*(t.experts_of(r, num_experts) for r in group)))
        assert experts == list(range(num_experts))
    for group in t.groups(Axis.EFSDP):  # same position in different copies: same experts
        assert len({tuple(t.experts_of(r, num_experts)) for r in group}) == 1
        assert len({t.ranks[r].ep for r in group}) == 1


@pytest.mark.parametrize("kwargs", [layout for layout in LAYOUTS if layout.get("ep_size", 1) > 1])
def test_topo4_an_ep_group_holds_ep_over_tp_batches(kwargs):
    t = topo(**kwargs)
    for group in t.groups(Axis.EP):
        assert len({t.ranks[r].batch for r in group}) == t.axis_size(Axis.EP) // t.axis_size(Axis.TP)


def test_topo3_groups():
    t = topo(tp_size=2, fsdp_size=4, ep_size=4)
    assert t.groups(Axis.TP) == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert t.groups(Axis.FSDP) == ((0, 2, 4, 6), (1, 3, 5, 7))
    assert t.groups(Axis.EP) == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert t.groups(Axis.EFSDP) == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert t.groups(Axis.DP_REPLICATE) == tuple((r,) for r in range(8))
    assert [t.experts_of(r, 8) for r in range(4)] == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]


def test_topo5_hsdp_replicas_are_node_blocks_and_shard_groups_stay_inside():
    t = topo(dp_replicate_size=2, fsdp_size=2, tp_size=2, ep_size=4)
    assert t.groups(Axis.DP_REPLICATE) == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert t.groups(Axis.FSDP) == ((0, 2), (1, 3), (4, 6), (5, 7))
    assert t.groups(Axis.EP) == ((0, 1, 2, 3), (4, 5, 6, 7))
    replica = {r.rank: r.dp_replicate for r in t.ranks}
    for axis in (Axis.FSDP, Axis.TP, Axis.EP, Axis.EFSDP):
        for group in t.groups(axis):
            assert len({replica[r] for r in group}) == 1, (axis, group)
    assert [r.batch for r in t.ranks] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert t.mesh_shape(DENSE_AXES) == (2, 1, 2, 1, 2) and t.mesh_shape(EXPERT_AXES) == (2, 1, 1, 4)


def test_tp1_every_rank_is_its_own_batch():
    t = topo(fsdp_size=4, ep_size=2)
    assert t.groups(Axis.TP) == ((0,), (1,), (2,), (3,))
    assert [r.batch for r in t.ranks] == [0, 1, 2, 3]
    assert t.groups(Axis.EP) == ((0, 1), (2, 3))
    assert t.groups(Axis.EFSDP) == ((0, 2), (1, 3))
    assert t.describe(num_experts=6) == (
        "rank         0       1       2       3\n"
        "batch       B0      B1      B2      B3     one batch per rank\n"
        "ep_size=2   E0-2    E3-5    E0-2    E3-5     group = two ranks,   efsdp_size=2"
    )


def test_describe_hsdp_shows_replicas_and_ep_coordinates_without_expert_count():
    picture = topo(dp_replicate_size=2, fsdp_size=2, ep_size=2).describe()
    lines = picture.splitlines()
    assert [line.split()[0] for line in lines] == ["rank", "replica", "batch", "ep_size=2"]
    assert lines[1].split()[1:] == ["0", "0", "1", "1"]
    assert lines[3].split()[1:5] == ["ep0", "ep1", "ep0", "ep1"]


def test_describe_rejects_an_ep_size_that_does_not_fit():
    with pytest.raises(ValueError, match=r"describe: ep_size=3 does not fit this layout.*\[CFG-3\]"):
        topo(tp_size=2, fsdp_size=4).describe(num_experts=8, ep_sizes=(3,))
    with pytest.raises(ValueError, match=r"num_experts=6 must be divisible by ep_size=4"):
        topo(tp_size=2, fsdp_size=4).describe(num_experts=6, ep_sizes=(4,))


def test_rank_label_names_coordinates():
    t = topo(tp_size=2, fsdp_size=4, ep_size=4)
    assert t.ranks[5].label() == "rank 5 (dp_replicate=0, pp=0, fsdp=2, cp=0, tp=1, ep=1, efsdp=1)"


def test_deferred_tp_is_resolved_from_world_size():
    config = DistributedConfig(tp_plan="auto", fsdp_size=2)
    with pytest.raises(ValueError, match="pass the world_size"):
        build_topology(config)
    t = build_topology(config, world_size=8)
    assert t.axis_size(Axis.TP) == 4 and t.world_size == 8


def test_world_size_must_match_config():
    with pytest.raises(ValueError, match=re.escape("[CFG-1]")):
        build_topology(DistributedConfig(tp_size=2), world_size=4)


def test_pipeline_stages_are_blocks_inside_a_replica_and_share_the_batches():
    t = topo(dp_replicate_size=2, pp_size=2, fsdp_size=2, tp_size=2, ep_size=2)
    assert t.world_size == 16 and t.mesh_shape(DENSE_AXES) == (2, 2, 2, 1, 2)
    assert [r.pp for r in t.ranks] == [0] * 4 + [1] * 4 + [0] * 4 + [1] * 4
    assert [r.batch for r in t.ranks[:8]] == [0, 0, 1, 1, 0, 0, 1, 1]
    # a pp group: the same place in every stage of one replica
    assert t.group_of(1, Axis.PP) == (1, 5) and t.group_of(10, Axis.PP) == (10, 14)
    # tp, fsdp and ep groups stay inside a stage (TOPO rules per stage)
    for axis in (Axis.TP, Axis.FSDP, Axis.EP, Axis.EFSDP):
        for group in t.groups(axis):
            assert len({t.ranks[r].pp for r in group}) == 1, (axis, group)
    assert t.batch_ranks()[1] == (2, 3, 6, 7)
    assert t.answer_ranks() == (4, 6, 12, 14)
    assert [r for r in range(16) if t.answers(r)] == [4, 6, 12, 14]
    assert "stage        0      0       0      0       1" in t.describe(8)
