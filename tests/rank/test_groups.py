"""Process groups by rank set (pure parts): how a group is described, and how a rank names it by its layout's axes."""

import pytest

from raymoe import DistributedConfig, build_topology
from raymoe.rank.contract import rank_set_desc, rank_set_of
from raymoe.rank.groups import axis_descs


def test_a_rank_set_description_reads_back_and_nothing_else_reads_as_one():
    assert rank_set_desc((0, 2, 5)) == "ranks_0_2_5"
    assert rank_set_of("ranks_0_2_5") == (0, 2, 5)
    for desc in ("mesh_tp", "default_pg", "ranks_", "ranks_0_x", ""):
        assert rank_set_of(desc) is None, desc


@pytest.mark.parametrize(
    ("config", "rank", "expected"),
    [
        # tp and ep group the same ranks, so do fsdp and efsdp; every size-1 axis shares the rank's own group
        (
            {"tp_size": 2, "ep_size": 2, "fsdp_size": 2},
            1,
            {"ranks_1": "mesh_dp_replicate/pp/cp", "ranks_1_3": "mesh_fsdp/efsdp", "ranks_0_1": "mesh_tp/ep"},
        ),
        (
            {"cp_size": 2, "fsdp_size": 2},
            3,
            {
                "ranks_3": "mesh_dp_replicate/pp/tp/ep",
                "ranks_1_3": "mesh_fsdp",
                "ranks_2_3": "mesh_cp",
                "default_pg": "mesh_efsdp",  # the whole world's rank set: the default group
            },
        ),
    ],
)
def test_a_rank_names_its_groups_by_the_axes_of_its_layout(config, rank, expected):
    assert axis_descs(build_topology(DistributedConfig(**config)), rank) == expected
