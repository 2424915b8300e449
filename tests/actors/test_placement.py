"""Preflight and rank order: pure logic on described clusters, no Ray needed."""

import pytest
import torch

from actors.placement import (
    NodeCapacity,
    Placement,
    PlacementError,
    PlacementRequest,
    check_fits,
    rank_backend,
    rank_env,
)
from raymoe import DistributedConfig, build_topology
from raymoe.rank.context import DeviceBinding, choose_binding


def nodes(*counts, gpus=True):
    return [
        NodeCapacity(f"n{i}", f"10.0.0.{i}", cpus=64.0, gpus=float(c)) if gpus else NodeCapacity(f"n{i}", "", c, 0.0)
        for i, c in enumerate(counts)
    ]


def test_request_groups_tp_and_ep_on_one_node():
    topo = build_topology(DistributedConfig(tp_size=2, fsdp_size=4, ep_size=4))
    request = PlacementRequest.for_topology(topo, use_gpu=True, cpus_per_rank=4)
    assert (request.world_size, request.block) == (8, 4)
    assert request.bundle() == {"GPU": 1.0, "CPU": 4}
    assert PlacementRequest.for_topology(topo, use_gpu=False, cpus_per_rank=2).bundle() == {"CPU": 2}


def test_missing_gpus_are_described():
    request = PlacementRequest(world_size=8, use_gpu=True, cpus_per_rank=1, block=4)
    with pytest.raises(PlacementError, match=r"needs 8 GPUs in groups of 4 per node, cluster has 2 nodes x 2 GPUs"):
        check_fits(request, nodes(2, 2))


def test_enough_gpus_but_groups_would_cross_nodes():
    request = PlacementRequest(world_size=8, use_gpu=True, cpus_per_rank=1, block=4)
    with pytest.raises(PlacementError, match=r"cluster has 3 nodes with 3, 3, 2 GPUs"):
        check_fits(request, nodes(3, 3, 2))
    check_fits(request, nodes(4, 4))
    check_fits(request, nodes(8))


def test_cpu_ranks_count_cpu_slots():
    request = PlacementRequest(world_size=4, use_gpu=False, cpus_per_rank=2, block=2)
    check_fits(request, nodes(8, gpus=False))
    with pytest.raises(
        PlacementError, match=r"needs 4 rank slots of 2 CPUs in groups of 2 per node, .*1 node x 6 CPUs"
    ):
        check_fits(request, nodes(6, gpus=False))
    with pytest.raises(PlacementError, match="no alive nodes"):
        check_fits(request, [])


def test_local_rank_counts_ranks_on_the_same_node():
    placement = Placement(group=None, bundle_of_rank=(0, 1, 2, 3), node_of_rank=("a", "a", "b", "b"))
    assert [placement.local_rank(r) for r in range(4)] == [0, 1, 0, 1]


def test_ranks_without_gpus_run_gloo_and_nccl_there_is_refused():
    assert rank_backend(use_gpu=False, backend=None) == "gloo"
    assert rank_backend(use_gpu=False, backend="gloo") == "gloo"
    with pytest.raises(ValueError, match=r"backend='nccl' with use_gpu=False: NCCL runs on GPUs"):
        rank_backend(use_gpu=False, backend="nccl")
    assert rank_backend(use_gpu=True, backend=None) == "nccl"
    assert rank_backend(use_gpu=True, backend="gloo") == "gloo"


def test_ranks_without_gpus_have_them_hidden():
    assert rank_env(use_gpu=False) == {"CUDA_VISIBLE_DEVICES": ""}
    assert rank_env(use_gpu=True) == {}


@pytest.mark.parametrize("rank", [0, 5])
def test_use_gpu_false_on_a_gpu_node_binds_the_cpu(rank):
    """Ray 2.60 leaves an actor of zero GPUs the node's CUDA_VISIBLE_DEVICES (all eight GPUs). The driver's choice and
    the hidden GPUs each make the rank a CPU rank on their own; before, every rank picked NCCL and cuda:0."""
    node_env = "0,1,2,3,4,5,6,7"
    visible = rank_env(use_gpu=False).get("CUDA_VISIBLE_DEVICES", node_env)
    seen = 0 if visible == "" else len(visible.split(","))
    cpu = DeviceBinding("gloo", torch.device("cpu"))
    assert choose_binding(rank, rank_backend(False, None), visible, seen) == cpu
    assert choose_binding(rank, rank_backend(False, None), node_env, 8) == cpu  # GPUs not hidden: still gloo
    assert choose_binding(rank, None, visible, seen) == cpu  # no backend sent: the hidden GPUs decide
