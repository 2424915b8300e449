"""The rank context's process groups: the world group and every sub-mesh group carry the configured timeout."""

import sys

import torch
import torch.distributed as dist
from ray import cloudpickle

cloudpickle.register_pickle_by_value(sys.modules[__name__])

MOE = "moe_e8_k2_mha"
SESSION_TIMEOUT_S = 300  # tests/conftest.py starts the shared worlds with collective_timeout_s=300


def timeouts(ctx):
    """Seconds of the world group and of each axis of both meshes, on this rank."""
    from raymoe.rank.context import group_timeout_s

    seen = {"world": group_timeout_s(dist.group.WORLD, ctx.device)}
    seen["checkpoint"] = group_timeout_s(ctx.checkpoint_group(), torch.device("cpu"))  # DCP's gloo group
    for mesh in (ctx.dense_mesh, ctx.expert_mesh):
        for axis in mesh.mesh_dim_names:
            seen[axis] = group_timeout_s(mesh.get_group(axis), ctx.device)
    return seen


def test_every_sub_mesh_group_carries_the_world_timeout(load_on_world, tiny_checkpoint):
    layout = {"dp_replicate_size": 2, "tp_size": 2, "ep_size": 2}
    with load_on_world(tiny_checkpoint(MOE), layout) as model:
        seen = model.run_on_ranks(timeouts)
    assert len(seen) == 4
    for rank_timeouts in seen:
        assert set(rank_timeouts) == {"world", "checkpoint", "dp_replicate", "pp", "fsdp", "tp", "efsdp", "ep"}
        assert set(rank_timeouts.values()) == {SESSION_TIMEOUT_S}, rank_timeouts
