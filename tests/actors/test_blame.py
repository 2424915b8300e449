"""Blaming the rank where a failure began: the pure sorting of outcomes, and a SIGKILLed rank under CPU load.

When a rank dies, its peers' collectives fail within milliseconds and which error reaches the driver first is
a race; the first line of the error must name the dead rank every time, never a survivor that lost its peer.
``RAYMOE_BLAME_REPEAT=9 pytest tests/actors/test_blame.py`` runs the kill tests nine times (each repetition kills
the next non-zero rank: each of them three times SIGKILLed, three times closing its connections before it dies).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from ray import cloudpickle

from actors import GroupOptions, RankError, RayRankGroup
from actors.blame import Fate, Outcome, assign_blame, death_cause
from raymoe import DistributedConfig, build_topology
from raymoe.rank.contract import FailureKind, GroupProgress, RankFailure, RankProgress

cloudpickle.register_pickle_by_value(sys.modules[__name__])

TOPOLOGY = build_topology(DistributedConfig(tp_size=2, fsdp_size=2))
LOST = "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer"
REPEAT = int(os.environ.get("RAYMOE_BLAME_REPEAT", "1"))


def lost_peer(op: str = "all_reduce", desc: str = "mesh_fsdp") -> Outcome:
    progress = RankProgress(0, "train_step", 1.0, (GroupProgress("3", desc, 5, 4, op, 0.1),))
    return Outcome.of_failure(RankFailure("RuntimeError", LOST, "Traceback: survivor", FailureKind.LOST_PEER, progress))


def test_the_dead_rank_is_primary_whatever_arrived_first():
    outcomes = {
        0: lost_peer(),
        1: Outcome(
            Fate.DIED, death_cause("The actor is dead because its worker process has died."), "", "10.0.0.2", 42
        ),
        2: lost_peer(),
        3: Outcome(Fate.WAITING, "in all_gather on the tp sub-mesh"),
    }
    blame = assign_blame("train_step", outcomes, TOPOLOGY)
    assert blame.primary == (1,) and blame.secondary == (0, 2, 3)
    first = blame.message.splitlines()[0]
    assert first.startswith(f"{TOPOLOGY.ranks[1].label()} died in train_step: its process exited")
    assert "on node 10.0.0.2 (pid 42)" in first
    assert "rank 0 (" in first and "rank 2 (" in first and "lost their peer in all_reduce on the fsdp sub-mesh" in first
    assert "still running (in all_gather on the tp sub-mesh)" in first
    assert blame.traceback == "Traceback: survivor" and blame.traceback_rank == 0  # the only traceback there is


def test_a_rank_that_raised_is_primary_and_its_traceback_is_shown():
    own = RankFailure("ValueError", "bad shard\nmore", "Traceback: own", FailureKind.RAISED)
    outcomes = {0: lost_peer(), 1: Outcome(Fate.ANSWERED), 2: Outcome.of_failure(own), 3: Outcome(Fate.SILENT)}
    blame = assign_blame("load_shards", outcomes, TOPOLOGY)
    assert blame.primary == (2,) and blame.traceback == "Traceback: own" and blame.traceback_rank == 2
    assert blame.message.startswith(f"{TOPOLOGY.ranks[2].label()} failed in load_shards: ValueError: bad shard;")
    assert "rank 3 (" in blame.message and "did not answer" in blame.message
    assert "rank 1 (" not in blame.message  # it finished its call


def test_only_secondary_failures_say_so():
    blame = assign_blame("train_step", {0: lost_peer(), 1: Outcome(Fate.SILENT)}, None)
    assert blame.primary == () and blame.message.startswith("no rank was seen failing first in train_step; rank 0 lost")


def test_death_causes_in_ray_words():
    assert "memory monitor" in death_cause("Task was killed due to the node running low on memory. OutOfMemoryError")
    assert death_cause("The actor was killed by ray.kill") == "killed by ray.kill"
    assert "SIGKILL" in death_cause("Worker unexpectedly exits with a connection error code 2. End of file.")


# --- a real kill, under load -------------------------------------------------------------------


def all_reduce_until_killed(ctx, victim: int, at: int, how: str) -> int:
    """Every rank all-reduces over all ranks; before its ``at``-th, ``victim`` is SIGKILLed (``"kill"``), or first
    closes its connections and dies a second later (``"closing"``: a process going down in stages), so that its
    peers' errors surely reach the driver before Ray reports the death.

    The all-reduces run on a group made here, which no mesh holds: destroying it frees it, and that closes its
    connections (a group a mesh still names keeps them until the process ends)."""
    group = dist.new_group()
    value = torch.ones(1 << 12)
    for step in range(10 * at):
        if ctx.rank == victim and step == at:
            if how == "closing":
                dist.destroy_process_group(group)
                del group  # the last reference
                time.sleep(1.0)  # the scenario: the connections are gone, the process not yet
            os.kill(os.getpid(), signal.SIGKILL)
        dist.all_reduce(value, group=group)
    return ctx.rank


@contextlib.contextmanager
def busy_cores() -> Iterator[None]:
    """Two busy processes, one per core of a 2-core CI machine: the ranks and Ray compete for the CPU while the block
    runs (it begins once both spin). Each stops by itself once its parent is gone (a pytest killed mid-test leaves no
    busy core behind)."""
    spin = f"import os\nprint(flush=True)\nwhile os.getppid() == {os.getpid()}:\n    for _ in range(10**6): pass"
    hogs = [subprocess.Popen([sys.executable, "-c", spin], stdout=subprocess.PIPE) for _ in range(2)]
    pipes = [hog.stdout for hog in hogs if hog.stdout is not None]
    try:
        for pipe in pipes:
            pipe.readline()  # spinning
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
        for pipe in pipes:
            pipe.close()


def fail_rank(group: RayRankGroup, victim: int, how: str, *, under_load: bool) -> RankError:
    """Kill ``victim`` (see :func:`all_reduce_until_killed`), ``under_load`` from the first all-reduce until the
    driver has the error (the race the load is for: which error reaches the driver first; the group's start and
    shutdown need none); the error, the group shut down."""
    try:
        with pytest.raises(RankError) as caught, busy_cores() if under_load else contextlib.nullcontext():
            group.execute(all_reduce_until_killed, victim, 20, how)
        assert not group.is_alive
    finally:
        group.shutdown()
    return caught.value


@pytest.mark.parametrize("repetition", range(REPEAT))
def test_a_killed_rank_is_named_first_under_load(ray_session, repetition):
    """Each repetition kills the next non-zero rank, the last first: every survivor's rank comes before it."""
    victim = TOPOLOGY.world_size - 1 - repetition % (TOPOLOGY.world_size - 1)
    group = RayRankGroup.for_topology(TOPOLOGY, GroupOptions(cpus_per_rank=0.25, collective_timeout_s=60))
    error = fail_rank(group, victim, "kill", under_load=True)
    first = str(error).splitlines()[0]
    assert first.startswith(f"rank {victim} (") and " died in all_reduce_until_killed: " in first, first
    assert error.primary == (victim,) and error.rank == victim, first


@pytest.mark.parametrize("repetition", range(REPEAT))
def test_a_rank_whose_connections_close_first_is_named_first_under_load(ray_session, repetition):
    """The survivors' errors surely arrive first here; the driver waits for the death they follow from. Each
    repetition kills the next non-zero rank."""
    victim = 1 + repetition % (TOPOLOGY.world_size - 1)
    group = RayRankGroup.for_topology(TOPOLOGY, GroupOptions(cpus_per_rank=0.25, collective_timeout_s=60))
    error = fail_rank(group, victim, "closing", under_load=True)
    first = str(error).splitlines()[0]
    assert first.startswith(f"rank {victim} (") and " died in all_reduce_until_killed: " in first, first
    assert error.primary == (victim,) and set(error.secondary) == set(range(4)) - {victim}, first
    assert "lost their peer" in first, first  # named after the primary, as secondary


def test_without_the_grace_the_survivors_errors_would_be_all_there_is(ray_session, monkeypatch):
    """The twin: the driver raising on the first errors it gets, as it did before, names no primary rank when the
    dead rank's connections closed before its death was reported."""
    import actors.group

    monkeypatch.setattr(actors.group, "BLAME_GRACE_S", 0.0)
    group = RayRankGroup.for_topology(TOPOLOGY, GroupOptions(cpus_per_rank=0.25, collective_timeout_s=60))
    error = fail_rank(group, 1, "closing", under_load=False)
    assert error.primary == () and str(error).startswith("no rank was seen failing first"), str(error)
