"""Hangs named in seconds: a frozen rank process, and a rank that never enters the collective the others wait in.

The first tests read synthetic progress reports (no Ray); the last two freeze or stall a real rank on a local
Ray and check what the driver raises, how fast, and that nothing is left running.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest
import torch
import torch.distributed as dist
from ray import cloudpickle

from actors import GroupOptions, RankHangError, RayRankGroup
from actors.hang import PROGRESS_ANSWER_S, diagnose, diagnosis_deadline_s, poll_interval_s
from raymoe import DistributedConfig, build_topology
from raymoe.rank.context import backend_timeout_s, mesh_backend_overrides
from raymoe.rank.contract import GroupProgress, RankProgress

cloudpickle.register_pickle_by_value(sys.modules[__name__])

TP2_FSDP2 = build_topology(DistributedConfig(tp_size=2, fsdp_size=2))


def report(rank, function="train_step", **groups):
    """``groups``: desc -> (name, entered, finished, op)."""
    return RankProgress(
        rank,
        function,
        30.0,
        tuple(
            GroupProgress(name, desc, entered, finished, op, 30.0)
            for desc, (name, entered, finished, op) in groups.items()
        ),
    )


def test_a_rank_missing_from_a_tp_collective_is_named_with_its_sub_mesh():
    reports = {
        0: report(0, mesh_tp=("3", 17, 16, "all_reduce")),
        1: report(1, mesh_tp=("3", 16, 16, "all_reduce")),  # never entered #17
        2: report(2, mesh_tp=("4", 17, 17, "all_reduce")),
        3: report(3, mesh_tp=("4", 17, 17, "all_reduce")),
    }
    diagnosis = diagnose("train_step", reports, TP2_FSDP2, 31.0)
    assert diagnosis.absent == (1,) and diagnosis.frozen == () and diagnosis.culprits == (1,)
    rank_1 = "rank 1 (dp_replicate=0, pp=0, fsdp=0, cp=0, tp=1, ep=0, efsdp=1)"
    assert f"{rank_1} never reached the collective" in diagnosis.message
    assert "running train_step, in no collective" in diagnosis.message
    rank_0 = "rank 0 (dp_replicate=0, pp=0, fsdp=0, cp=0, tp=0, ep=0, efsdp=0)"
    assert f"{rank_0} waited 30 s in all_reduce #17 on the tp sub-mesh" in diagnosis.message


def test_a_silent_rank_is_frozen_and_ranks_in_other_groups_are_not_blamed():
    reports = {
        0: report(0, mesh_fsdp=("5", 3, 2, "_allgather_base")),
        1: report(1, mesh_fsdp=("6", 3, 2, "_allgather_base")),
        2: None,
        3: report(3, mesh_fsdp=("6", 3, 3, "_allgather_base")),
    }
    diagnosis = diagnose("train_step", reports, TP2_FSDP2, 25.0)
    assert diagnosis.frozen == (2,) and diagnosis.absent == ()
    assert "rank 2 (dp_replicate=0, pp=0, fsdp=1, cp=0, tp=0, ep=0, efsdp=2) stopped responding" in diagnosis.message
    assert [w.axis for w in diagnosis.waiting] == ["fsdp", "fsdp"]


CP2_FSDP2_TP2 = build_topology(DistributedConfig(cp_size=2, fsdp_size=2, tp_size=2))


def test_fsdp2s_group_under_cp_has_the_fsdp_times_cp_ranks_and_blames_only_its_own():
    """``mesh_fsdp_cp`` (torch's flattened group): ranks 0, 2, 4, 6 share one, 1, 3, 5, 7 the other; rank 2 is the one
    behind, and the other group's ranks, which never report the first one, are not counted as late."""
    group = {0: "8", 2: "8", 4: "8", 6: "8", 1: "9", 3: "9", 5: "9", 7: "9"}
    entered = {rank: (4 if rank == 2 else 5) for rank in range(8)}
    finished = {rank: (4 if group[rank] == "8" else 5) for rank in range(8)}
    reports = {
        rank: report(rank, **{"mesh_fsdp_cp": (group[rank], entered[rank], finished[rank], "_allgather_base")})
        for rank in range(8)
    }
    diagnosis = diagnose("train_step", reports, CP2_FSDP2_TP2, 30.0)
    assert diagnosis.absent == (2,) and diagnosis.frozen == (), diagnosis.message
    assert [(w.axis, w.ranks) for w in diagnosis.waiting] == [("fsdp_cp", (0, 4, 6))]


def test_a_group_is_named_by_its_axes_or_else_by_its_ranks():
    """Two axes over the same ranks (``mesh_tp/ep``) find their members by the first; a group of an earlier layout
    (``ranks_0_2``) by the ranks it names."""
    layout = build_topology(DistributedConfig(tp_size=2, ep_size=2))
    shared = {
        0: report(0, **{"mesh_tp/ep": ("3", 9, 8, "all_to_all")}),
        1: report(1, **{"mesh_tp/ep": ("3", 8, 8, "all_to_all")}),
    }
    diagnosis = diagnose("train_step", shared, layout, 30.0)
    assert diagnosis.absent == (1,) and "all_to_all #9 on the tp/ep sub-mesh" in diagnosis.message
    earlier = {
        0: report(0, ranks_0_2=("7", 3, 2, "broadcast")),
        1: report(1),
        2: report(2, ranks_0_2=("7", 2, 2, "broadcast")),
        3: report(3),
    }
    assert diagnose("train_step", earlier, TP2_FSDP2, 30.0).absent == (2,)


def test_a_world_collective_blames_every_rank_behind_and_nothing_is_invented():
    waiting = {0: report(0, default_pg=("0", 5, 4, "barrier")), 1: report(1, default_pg=("0", 4, 4, "barrier"))}
    assert diagnose("save", waiting, None, 12.0).absent == (1,)
    idle = {0: report(0, default_pg=("0", 5, 5, "barrier")), 1: report(1, default_pg=("0", 5, 5, "barrier"))}
    quiet = diagnose("save", idle, None, 12.0)
    assert quiet.culprits == () and "No rank could be named" in quiet.message


# --- on a local Ray ------------------------------------------------------------------------------


def freeze_rank_one_at_next_forward(ctx):
    """Rank 1 stops its own process (SIGSTOP) when the next forward starts: frozen inside train_step."""
    if ctx.rank == 1:
        model = ctx.require_model().model
        model.register_forward_pre_hook(lambda *_: os.kill(os.getpid(), signal.SIGSTOP))
    return os.getpid()


@pytest.mark.parametrize("timeout_s", [1.0, 10.0, 60.0, 300.0, 1800.0])
def test_nccl_groups_outwait_the_drivers_hang_diagnosis(timeout_s):
    """NCCL's watchdog ends a rank's process at its group's timeout (a frozen peer then reads as "actor died", no
    culprit named); the driver holds every rank's report by ``diagnosis_deadline_s``, which must come first."""
    deadline = diagnosis_deadline_s(timeout_s)
    assert deadline == timeout_s + poll_interval_s(timeout_s) + PROGRESS_ANSWER_S
    assert backend_timeout_s("nccl", timeout_s) > deadline
    # what the sub-mesh groups are created with (a real options type stands in for CUDA-only ProcessGroupNCCL.Options)
    overrides = mesh_backend_overrides("nccl", 4, timeout_s, new_options=dist.ProcessGroupGloo._Options)
    assert min(options._timeout.total_seconds() for _, options in overrides) > deadline
    # gloo raises in the rank at the timeout and the rank reports it: no margin needed
    assert backend_timeout_s("gloo", timeout_s) == timeout_s


def test_a_frozen_rank_is_named_within_40_s_and_nothing_is_left(ray_tables, tiny_checkpoint):
    import raymoe

    model = raymoe.from_pretrained(
        tiny_checkpoint("moe_e8_k2_mha"),
        distributed_config=DistributedConfig(tp_size=2, fsdp_size=2),
        cpus_per_rank=0.25,
        collective_timeout_s=10,
    )
    model.configure_training(lr=1e-3)
    pids = model.run_on_ranks(freeze_rank_one_at_next_forward)
    group = model._lease.group()
    actors = {actor._actor_id.hex() for actor in group._actors}
    placement = group._placement.group.id.hex()
    began = time.monotonic()
    with pytest.raises(RankHangError) as caught:
        model.train_step(torch.randint(0, 96, (4, 8)))
    took = time.monotonic() - began
    print(f"frozen rank named after {took:.1f} s")  # shown with -s
    assert took < 40
    message = str(caught.value)
    assert "rank 1 (dp_replicate=0, pp=0, fsdp=0, cp=0, tp=1, ep=0, efsdp=1) stopped responding" in message, message
    assert caught.value.diagnosis.frozen == (1,) and caught.value.diagnosis.culprits == (1,), message
    assert not model.is_alive
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        alive, groups = ray_tables.rank_actors(), ray_tables.live_placement_groups()
        processes = [pid for pid in pids if _exists(pid)]
        if not (alive & actors) and placement not in groups and not processes:
            break
        time.sleep(0.5)
    assert not (alive & actors) and placement not in groups, "actors or the placement group outlived the hang"
    assert not processes, f"rank processes {processes} outlived the hang (the frozen one among them?)"


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie is gone, only not yet reaped
        return stat.read().split()[2] != "Z"


def rank_one_skips_the_tp_all_reduce(ctx):
    if ctx.rank == 1:
        time.sleep(120)  # stuck elsewhere: a storage read, a loop
        return ctx.rank
    total = torch.ones(1)
    dist.all_reduce(total, group=ctx.mesh("tp").get_group())
    return ctx.rank


def test_a_rank_that_skips_a_collective_is_named_with_the_sub_mesh_and_collective(ray_session):
    group = RayRankGroup.for_topology(
        TP2_FSDP2, GroupOptions(collective_timeout_s=10, placement_timeout_s=30, cpus_per_rank=0.25)
    )
    began = time.monotonic()
    with pytest.raises(RankHangError) as caught:
        group.execute(rank_one_skips_the_tp_all_reduce)
    assert time.monotonic() - began < 30
    message = str(caught.value)
    assert caught.value.diagnosis.absent == (1,), message
    assert "rank 1 (dp_replicate=0, pp=0, fsdp=0, cp=0, tp=1, ep=0, efsdp=1) never reached the collective" in message
    assert "running rank_one_skips_the_tp_all_reduce" in message
    assert "waited" in message and "all_reduce #" in message and "on the tp sub-mesh" in message
    assert not group.is_alive
