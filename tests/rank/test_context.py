"""The rank context's process groups: the world group and every sub-mesh group carry the configured timeout; the device
a rank binds (pure: the GPU branches run without a GPU); one process-group options object per mesh dimension."""

import socket
import sys
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from ray import cloudpickle

from raymoe import DistributedConfig, build_topology
from raymoe.rank.context import (
    NCCL_TIMEOUT_MARGIN_S,
    DeviceBinding,
    backend_timeout_s,
    choose_binding,
    group_timeout_s,
    host_world_store,
    join_world,
    mesh_backend_overrides,
)
from raymoe.rank.contract import Rendezvous
from raymoe.rank.local import LocalRankGroup
from raymoe.spec.topology import Axis

cloudpickle.register_pickle_by_value(sys.modules[__name__])

MOE = "moe_e8_k2_mha"
SESSION_TIMEOUT_S = 300  # tests/conftest.py starts the shared worlds with collective_timeout_s=300


def timeouts(ctx):
    """Seconds of the world group, DCP's checkpoint group and each axis of both meshes, on this rank."""
    seen = _group_timeouts(ctx)
    seen["checkpoint"] = group_timeout_s(ctx.checkpoint_group(), torch.device("cpu"))  # DCP's gloo group
    return seen


@pytest.mark.parametrize(
    ("layout", "extra"),
    [({"dp_replicate_size": 2, "tp_size": 2, "ep_size": 2}, set()), ({"cp_size": 2, "fsdp_size": 2}, {"fsdp_cp"})],
)
def test_every_sub_mesh_group_carries_the_world_timeout(load_on_world, tiny_checkpoint, layout, extra):
    with load_on_world(tiny_checkpoint(MOE), layout) as model:
        seen = model.run_on_ranks(timeouts)
    assert len(seen) == 4
    for rank_timeouts in seen:
        axes = {"world", "checkpoint", "dp_replicate", "pp", "fsdp", "cp", "tp", "efsdp", "ep"}
        assert set(rank_timeouts) == axes | extra
        assert set(rank_timeouts.values()) == {SESSION_TIMEOUT_S}, rank_timeouts


# --- device binding, options per mesh dimension, group timeouts: pure, no GPU, no NCCL ------------------------------


def test_gloo_binds_the_cpu_even_where_gpus_are_visible():
    assert choose_binding(0, "gloo", "0,1,2,3", 4) == DeviceBinding("gloo", torch.device("cpu"))
    assert choose_binding(2, "gloo", "", 0) == DeviceBinding("gloo", torch.device("cpu"))


def test_nccl_binds_the_one_gpu_this_process_sees():
    # Ray shows a GPU rank its own GPU (CUDA_VISIBLE_DEVICES="5"), which torch numbers 0
    assert choose_binding(5, "nccl", "5", 1) == DeviceBinding("nccl", torch.device("cuda", 0))


@pytest.mark.parametrize(
    ("visible", "count", "shown"),
    [("0,1,2,3,4,5,6,7", 8, "'0,1,2,3,4,5,6,7'"), (None, 2, "unset"), ("", 0, "''")],
)
def test_nccl_without_exactly_one_gpu_names_rank_visible_devices_and_count(visible, count, shown):
    with pytest.raises(RuntimeError) as raised:
        choose_binding(3, "nccl", visible, count)
    message = str(raised.value)
    assert message.startswith("rank 3: backend 'nccl' needs exactly one visible GPU per rank")
    assert f"torch.cuda.device_count() = {count}" in message
    assert f"CUDA_VISIBLE_DEVICES {shown}" in message


def test_no_backend_asked_picks_by_the_gpus_seen_and_still_refuses_several():
    assert choose_binding(0, None, "", 0) == DeviceBinding("gloo", torch.device("cpu"))
    assert choose_binding(0, None, "3", 1) == DeviceBinding("nccl", torch.device("cuda", 0))
    # the bug of issue 36: every rank of a node seeing all its GPUs used to land on cuda:0
    with pytest.raises(RuntimeError, match=r"rank 1: .* sees 8 "):
        choose_binding(1, None, "0,1,2,3,4,5,6,7", 8)


def _distinct(overrides):
    return len({id(options) for _, options in overrides}) == len(overrides)


def test_every_mesh_dimension_gets_an_options_object_of_its_own():
    # ProcessGroupNCCL.Options needs a CUDA build; the factory's NCCL branch is driven with a real options type that
    # this build has, which is all it calls.
    nccl = mesh_backend_overrides("nccl", 4, 300.0, new_options=dist.ProcessGroupGloo._Options)
    assert len(nccl) == 4 and _distinct(nccl)
    assert {backend for backend, _ in nccl} == {"nccl"}
    assert {options._timeout.total_seconds() for _, options in nccl} == {300.0 + NCCL_TIMEOUT_MARGIN_S}
    gloo = mesh_backend_overrides("gloo", 4, 300.0)
    assert len(gloo) == 4 and _distinct(gloo)
    assert {backend for backend, _ in gloo} == {"gloo"}
    assert {options._timeout.total_seconds() for _, options in gloo} == {300.0}
    # two calls (the dense and the expert mesh) share nothing either
    other = mesh_backend_overrides("gloo", 4, 300.0)
    assert not {id(o) for _, o in gloo} & {id(o) for _, o in other}


def test_only_nccl_groups_wait_beyond_the_collective_timeout():
    assert backend_timeout_s("gloo", 300.0) == 300.0
    assert backend_timeout_s("nccl", 300.0) == 300.0 + NCCL_TIMEOUT_MARGIN_S


def _group_timeouts(ctx):
    """Seconds of the world group and of each axis of both meshes (and fsdp_cp under cp), on this rank."""
    seen = {"world": group_timeout_s(dist.group.WORLD, ctx.device)}
    for mesh in (ctx.dense_mesh, ctx.expert_mesh):
        for axis in mesh.mesh_dim_names:
            seen[axis] = group_timeout_s(mesh.get_group(axis), ctx.device)
    if ctx.topology.axis_size("cp") > 1:  # FSDP2's dense shard group: fsdp and cp flattened
        seen["fsdp_cp"] = group_timeout_s(ctx.dense_mesh["fsdp_cp"].get_group(), ctx.device)
    return seen


def test_a_local_gloo_world_gives_every_sub_mesh_group_the_timeout_through_its_own_options():
    """gloo takes nothing from the options but ``_timeout`` (DeviceMesh passes it to ``new_group``); without an
    options object a sub-mesh group would wait torch's 30 minutes."""
    group = LocalRankGroup(collective_timeout_s=77.0)
    try:
        group.use_layout(build_topology(DistributedConfig(), 1))
        (seen,) = group.execute(_group_timeouts)
    finally:
        group.shutdown()
    assert set(seen) == {"world", "dp_replicate", "pp", "fsdp", "cp", "tp", "efsdp", "ep"}
    assert set(seen.values()) == {77.0}, seen


# --- the rendezvous: rank 0's store is listening before any rank is told its port ----------------------------------


def test_rank_zero_hosts_the_world_store_on_a_port_already_bound():
    """The port the driver hands every rank is held from the moment it is known: nothing else can bind it, and a
    rank connecting to it finds the store (a port found free and bound later could be taken in between)."""
    store = host_world_store("127.0.0.1", 2)
    with socket.socket() as other, pytest.raises(OSError):
        other.bind(("127.0.0.1", store.port))
    peer = dist.TCPStore("127.0.0.1", store.port, 2, is_master=False, timeout=timedelta(seconds=30))
    peer.set("hello", "from rank 1")
    assert store.get("hello") == b"from rank 1"


@pytest.mark.parametrize(("rank", "hosted"), [(0, False), (1, True)])
def test_only_rank_zero_joins_with_the_store_it_hosts(rank, hosted):
    store = host_world_store("127.0.0.1", 2) if hosted else None
    with pytest.raises(ValueError, match=f"rank {rank}: rank 0 joins with the store it hosts"):
        join_world(Rendezvous(rank, rank, 2, "127.0.0.1", 1, "gloo", 30.0), store)
    assert not dist.is_initialized()


# --- process groups by rank set: a world regrouped for many layouts makes each rank set's group once ----------------


def gloo_threads(ctx):
    """This rank's gloo loop threads (one per live group), a sum over each axis of the current layout, the pooled
    groups (the default group, which an axis over every rank runs on, is not one of them)."""
    import os

    task = f"/proc/{os.getpid()}/task"
    names = []
    for thread in os.listdir(task):
        try:
            with open(f"{task}/{thread}/comm") as comm:
                names.append(comm.read().strip())
        except FileNotFoundError:  # a thread that ended while listed
            continue
    sums = {}
    for axis in Axis:
        one = torch.ones(1)
        group = ctx.mesh(axis).get_group()
        dist.all_reduce(one, group=group)
        sums[axis.value] = int(one)
        # an axis over every rank runs on the default group, never on a second group of the same ranks
        assert (group is dist.group.WORLD) == (ctx.topology.axis_size(axis) == ctx.world_size), axis
    if ctx.topology.axis_size(Axis.CP) > 1:
        one = torch.ones(1)
        dist.all_reduce(one, group=ctx.dense_mesh["fsdp_cp"].get_group())
        sums["fsdp_cp"] = int(one)
    return sum(name.startswith("gloo_tcp_loop") for name in names), sums, len(ctx.group_pool())


MESH_LAYOUTS = [
    {"tp_size": 2, "fsdp_size": 2},
    {"cp_size": 2, "fsdp_size": 2, "ep_size": 4},
    {"dp_replicate_size": 2, "tp_size": 2, "ep_size": 2},
    {"pp_size": 2, "fsdp_size": 2, "ep_size": 2},
    {"fsdp_size": 4, "ep_size": 4},
    {"tp_size": 4},
]


def test_a_regrouped_world_makes_each_rank_sets_group_once_and_every_axis_still_works(world):
    """Layout after layout on one world: every axis sums over its ranks, and once each layout has been seen no
    group, and no gloo thread, is added (left to DeviceMesh, each layout would add one group per dimension)."""
    group = world(4)
    seen_after = []
    for config in MESH_LAYOUTS * 2:  # the second round meets only shapes and rank sets the first one made
        topology = build_topology(DistributedConfig(**config), 4)
        group.use_layout(topology)
        for rank, (threads, sums, pooled) in enumerate(group.execute(gloo_threads)):
            expected = {axis.value: topology.axis_size(axis) for axis in Axis}
            if topology.axis_size(Axis.CP) > 1:
                expected["fsdp_cp"] = topology.axis_size(Axis.FSDP) * topology.axis_size(Axis.CP)
            assert sums == expected, (config, rank)
            assert pooled <= 15  # the non-empty subsets of 4 ranks
            if rank == 0:
                seen_after.append((threads, pooled))
    first, second = seen_after[: len(MESH_LAYOUTS)], seen_after[len(MESH_LAYOUTS) :]
    assert second == [first[-1]] * len(MESH_LAYOUTS), seen_after
