"""The Ray implementation of the driver's rank group: create, fan out, gather, fail as one, shut down
(SPEC RAY-1…RAY-3; the protocol is :class:`raymoe.driver.group.RankGroup`).

    create(world_size)  preflight -> placement group -> one actor per rank -> rendezvous -> process group
    use_layout(topo)                every rank builds (or reuses) that layout's meshes
    execute(fn, *args)              the same call on every rank, results in rank order
    execute_per_rank(fn, args_of)   rank r gets args_of[r] (e.g. its slice of the batch)
    shutdown()                      kill actors, remove the placement group; idempotent

Any rank's exception, or a rank actor dying, ends the call with one :class:`RankError` whose first line names
the rank(s) where the failure began (:mod:`actors.blame`): once one rank's call failed, the driver gives every
other rank up to ``BLAME_GRACE_S`` to report its own outcome (its call's result, or, asked from its monitor
thread, whether it is alive and where it waits; Ray answers that for a dead actor), so a survivor whose
collective lost its peer is never blamed for the rank that died. The group is then shut down, since the
surviving ranks may be stuck in a collective. While no primary failure (a death, a rank's own exception) has
been seen, the ranks that lost their peer are consequences of one still to come, and it waits on, within the
same bound.

A call that hangs is caught by the driver's own watchdog: once it has run for ``collective_timeout_s``,
every few seconds the driver asks each rank for its progress (answered from a second thread of the
actor). When a rank does not answer (a frozen process) or ranks have waited in one collective for the
timeout, it raises :class:`RankHangError` naming the ranks the others wait for, their coordinates, the
sub-mesh and the collective (:mod:`actors.hang`), and frees every actor and the placement group. A rank
whose own collective timed out first is diagnosed the same way before the error is raised.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.blame import Fate, Outcome, assign_blame, death_cause
from actors.cluster import track_world
from actors.hang import PROGRESS_ANSWER_S, Diagnosis, diagnose, poll_interval_s
from actors.placement import (
    Placement,
    PlacementRequest,
    check_fits,
    cluster_nodes,
    node_block,
    place,
    rank_backend,
    rank_env,
)
from actors.rank import CONCURRENCY_GROUPS, RankActor
from actors.shared_paths import check_nodes_see
from raymoe.rank.context import use_layout
from raymoe.rank.contract import DEFAULT_COLLECTIVE_TIMEOUT_S, Backend, RankFailure, RankProgress, Rendezvous
from raymoe.spec.shared_paths import SharedPath
from raymoe.spec.topology import Topology

logger = logging.getLogger(__name__)

# Once a rank's call failed, how long the others get to report their own outcome (Ray takes well under a second
# to report a dead actor, a live rank's monitor thread answers in milliseconds): the bound on the wait, not a pause.
BLAME_GRACE_S = 10.0


class RankError(RuntimeError):
    """A rank failed; ``rank`` (the first of ``primary``), ``function`` and ``remote_traceback`` say where and how.

    ``primary``: the ranks where the failure began (died, or their own code raised; empty when none was seen, and
    ``rank`` is then the lowest rank that failed); ``secondary``: the others (lost their peer, still waiting, did
    not answer); ``cause``: the message's first line, which names the primary ranks."""

    def __init__(
        self,
        message: str,
        rank: int,
        function: str,
        remote_traceback: str,
        primary: tuple[int, ...] | None = None,
        secondary: tuple[int, ...] = (),
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.function = function
        self.remote_traceback = remote_traceback
        self.primary = primary if primary is not None else ((rank,) if rank >= 0 else ())
        self.secondary = secondary

    @property
    def cause(self) -> str:
        text = str(self).strip()
        return text.splitlines()[0] if text else ""


class RankHangError(RankError):
    """A call made no progress for the collective timeout; ``diagnosis`` names the ranks the others waited for
    (``diagnosis.frozen``: did not answer; ``diagnosis.absent``: never entered the collective)."""

    def __init__(self, message: str, rank: int, function: str, remote_traceback: str, diagnosis: Diagnosis) -> None:
        super().__init__(message, rank, function, remote_traceback)
        self.diagnosis = diagnosis


# Ray starts worker processes at niceness 15 so that its own daemons stay responsive; a rank actor is the training
# process itself, and at 15 it loses the CPU to anything else on the node (a data loader, a second job), which then
# paces every collective. Ranks run at the niceness torchrun would give them (benchmarks/bench_layouts.py).
RANK_PROCESS_ENV = {"RAY_worker_niceness": "0"}


@dataclass(frozen=True)
class GroupOptions:
    """How ranks are placed and how long the runtime waits before calling something stuck."""

    use_gpu: bool = False
    cpus_per_rank: float = 1.0
    backend: Backend | None = None
    placement_timeout_s: float = 120.0
    collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S


class RayRankGroup:
    """One Ray actor per rank of a world; see the module docstring for the life cycle."""

    def __init__(
        self,
        world_size: int,
        placement: Placement,
        actors: list[Any],
        options: GroupOptions,
        block: int = 1,
        shared: Sequence[SharedPath] = (),
    ) -> None:
        self._world_size = world_size
        self._options, self._block = options, block
        self._shared = tuple(shared)  # asked again of a replacement's nodes
        self.topology: Topology | None = None  # the layout in use, for naming ranks in errors
        self._placement: Placement | None = placement
        self._actors = actors
        self._timeout_s = options.collective_timeout_s
        self._processes: list[tuple[str, int]] = []  # (node id, pid) of each rank, to make sure they end
        self._node_ips: list[str] = []  # each rank's node address, for messages

    @classmethod
    def create(
        cls, world_size: int, options: GroupOptions, *, block: int = 1, shared: Sequence[SharedPath] = ()
    ) -> RayRankGroup:
        """Place and start ``world_size`` ranks, ``block`` consecutive ones per node, and join them into
        one process group. ``shared``: local paths every node the ranks are placed on must see as the driver does
        (:mod:`raymoe.spec.shared_paths`), asked once the nodes are known, before any rank starts."""
        backend = rank_backend(options.use_gpu, options.backend)  # before anything starts: bad input fails here
        request = PlacementRequest(world_size, options.use_gpu, options.cpus_per_rank, block)
        check_fits(request, cluster_nodes())
        placement = place(request, options.placement_timeout_s)
        try:
            check_nodes_see(shared, placement.node_of_rank, timeout_s=options.placement_timeout_s)
        except BaseException:
            placement.remove()
            raise
        actor_class = ray.remote(concurrency_groups=CONCURRENCY_GROUPS)(RankActor)  # type: ignore[call-overload]
        actors = [
            actor_class.options(
                num_cpus=options.cpus_per_rank,
                num_gpus=1 if options.use_gpu else 0,
                runtime_env={"env_vars": {**RANK_PROCESS_ENV, **rank_env(options.use_gpu)}},
                scheduling_strategy=PlacementGroupSchedulingStrategy(placement.group, bundle),
            ).remote()
            for bundle in placement.bundle_of_rank
        ]
        group = cls(world_size, placement, actors, options, block, shared)
        track_world(group)
        try:
            group._join(options, backend)
        except BaseException:
            group.shutdown()
            raise
        return group

    @classmethod
    def for_topology(
        cls, topology: Topology, options: GroupOptions, *, shared: Sequence[SharedPath] = ()
    ) -> RayRankGroup:
        """A world sized and placed for ``topology`` (its tp / ep groups on one node), already in that layout;
        ``shared`` as for :meth:`create`."""
        group = cls.create(topology.world_size, options, block=node_block(topology), shared=shared)
        group.use_layout(topology)
        return group

    def replacement(self) -> RayRankGroup:
        """New rank actors for a world a failure ended: the same size, options and node blocks, placed afresh (on
        other nodes if one is gone), in this world's layout."""
        group = RayRankGroup.create(self._world_size, self._options, block=self._block, shared=self._shared)
        try:
            if self.topology is not None:
                group.use_layout(self.topology)
        except BaseException:
            group.shutdown()
            raise
        return group

    @property
    def world_size(self) -> int:
        return self._world_size

    def check_shared(self, needs: Sequence[SharedPath]) -> None:
        """Raise ``ValueError`` when a node hosting ranks (not the driver's) does not see ``needs`` as the driver
        does (:mod:`raymoe.spec.shared_paths`); nothing runs when every rank is on the driver's node."""
        check_nodes_see(needs, self._live_placement().node_of_rank, timeout_s=self._options.placement_timeout_s)

    def use_layout(self, topology: Topology) -> None:
        """Regroup the ranks as ``topology``: its tp / ep groups must not cross nodes."""
        if topology.world_size != self._world_size:
            raise ValueError(
                f"the layout needs {topology.world_size} ranks, this world has {self._world_size}; start a world of "
                f"{topology.world_size} ranks (or choose sizes whose product is {self._world_size})"
            )
        placement = self._live_placement()
        placement.check_blocks(node_block(topology))
        self.execute(use_layout, topology)
        self.topology = topology

    def _join(self, options: GroupOptions, backend: Backend) -> None:
        address, port = self._gather(
            "host_rendezvous", [self._actors[0].host_rendezvous.remote(self._world_size)], [0]
        )[0]
        placement = self._live_placement()
        meeting = [
            Rendezvous(
                rank=rank,
                local_rank=placement.local_rank(rank),
                world_size=self._world_size,
                master_addr=address,
                master_port=port,
                backend=backend,
                collective_timeout_s=options.collective_timeout_s,
            )
            for rank in range(self._world_size)
        ]
        self._gather("setup", [actor.setup.remote(r) for actor, r in zip(self._actors, meeting, strict=True)])
        where = ray.get([actor.process_id.remote() for actor in self._actors])
        self._processes = [(node, pid) for node, pid, _ in where]
        self._node_ips = [ip for _, _, ip in where]

    # --- fan-out ---------------------------------------------------------------------------------

    def execute(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """``fn(ctx, *args, **kwargs)`` on every rank; results in rank order."""
        return self.execute_per_rank(fn, [args] * self._world_size, kwargs)

    def execute_per_rank(
        self,
        fn: Callable[..., Any],
        args_of_rank: Sequence[tuple[Any, ...]],
        kwargs: dict[str, Any] | None = None,
        objects_of_rank: Sequence[Sequence[Any]] | None = None,
    ) -> list[Any]:
        """``fn(ctx, *args_of_rank[r], *objects, **kwargs)`` on each rank r, ``objects`` the values of the object
        references ``objects_of_rank[r]``: Ray resolves them on the rank's node (top-level task arguments), so they
        never pass through the driver; results in rank order."""
        actors = self._live_actors()
        if len(args_of_rank) != len(actors):
            raise ValueError(f"execute_per_rank needs {len(actors)} argument tuples, got {len(args_of_rank)}")
        objects = objects_of_rank if objects_of_rank is not None else [()] * len(actors)
        refs = [
            actor.run.remote(fn, tuple(args), kwargs or {}, *refs)
            for actor, args, refs in zip(actors, args_of_rank, objects, strict=True)
        ]
        return self._gather(getattr(fn, "__qualname__", repr(fn)), refs)

    def _live_actors(self) -> list[Any]:
        self._live_placement()
        return self._actors

    def _live_placement(self) -> Placement:
        if self._placement is None:
            raise RuntimeError("this rank group was shut down; load the model again to get a new one")
        return self._placement

    def _gather(self, function: str, refs: list[Any], ranks: Sequence[int] | None = None) -> list[Any]:
        """Results in order; a failure (exception or dead actor) shuts the group down and raises, blaming the
        rank(s) where it began."""
        ranks = list(ranks) if ranks is not None else list(range(len(refs)))
        rank_of_ref = {ref: rank for ref, rank in zip(refs, ranks, strict=True)}
        results: dict[int, Any] = {}
        pending = list(refs)
        started = time.monotonic()
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=self._poll_s)
            if not ready:
                self._check_progress(function, started)
                continue
            rank = rank_of_ref[ready[0]]
            value, outcome = self._outcome(rank, ready[0])
            if outcome is not None:
                if outcome.fate is Fate.TIMED_OUT:  # its collective timed out: name whom it waited for
                    assert isinstance(value, RankFailure)
                    self._fail_hung(function, time.monotonic() - started, (rank, value))
                others = {rank_of_ref[ref]: ref for ref in pending}
                self._fail(function, {**{r: Outcome(Fate.ANSWERED) for r in results}, rank: outcome}, others)
            results[rank] = value
        return [results[rank] for rank in ranks]

    def _outcome(self, rank: int, ref: Any) -> tuple[Any, Outcome | None]:
        """A finished call's value, and its :class:`Outcome` when it failed (None: it succeeded)."""
        try:
            value = ray.get(ref)
        except ray.exceptions.RayError as exc:
            return None, self._outcome_of_death(rank, exc)
        if isinstance(value, RankFailure):
            return value, Outcome.of_failure(value, *self._whereabouts(rank))
        return value, None

    def _fail(self, function: str, outcomes: dict[int, Outcome], pending: dict[int, Any]) -> NoReturn:
        """Collect the other ranks' outcomes (bounded by ``BLAME_GRACE_S``), blame, shut down and raise."""
        primary_known = any(outcome.fate.primary for outcome in outcomes.values())
        outcomes = {**outcomes, **self._settle(pending, primary_known)}
        blame = assign_blame(function, outcomes, self.topology)
        logger.error("%s", blame.message)
        self.shutdown()
        culprit = blame.primary[0] if blame.primary else min(outcomes)
        tail = (
            f"\n--- traceback on rank {blame.traceback_rank} ---\n{blame.traceback.rstrip()}" if blame.traceback else ""
        )
        raise RankError(
            blame.message + tail,
            rank=culprit,
            function=function,
            remote_traceback=blame.traceback,
            primary=blame.primary,
            secondary=blame.secondary,
        )

    def _settle(self, pending: dict[int, Any], primary_known: bool) -> dict[int, Outcome]:
        """Each pending rank's outcome: its call's, once it ends (a dead actor's call ends with Ray's word that it
        died); else what its monitor thread answers (alive: where it waits).

        Returns as soon as every pending rank has an outcome or a monitor answer and a primary failure (a death, a
        rank's own exception) is known; while none is, the ranks that lost their peer are consequences of a failure
        not yet seen, so it waits on (a dying process may close its connections before Ray sees it end), up to
        ``BLAME_GRACE_S`` in all."""
        probes = {actor_ref: rank for rank in pending if (actor_ref := self._probe(rank)) is not None}
        calls = {ref: rank for rank, ref in pending.items()}
        outcomes: dict[int, Outcome] = {}
        alive: dict[int, Outcome] = {}
        deadline = time.monotonic() + BLAME_GRACE_S
        unresolved = [*calls, *probes]
        while unresolved and len(outcomes) < len(pending):
            if primary_known and set(alive) | set(outcomes) >= set(pending):
                break  # the cause is known and every other rank is accounted for
            ready, unresolved = ray.wait(unresolved, num_returns=1, timeout=max(deadline - time.monotonic(), 0))
            if not ready:
                break
            ref = ready[0]
            if ref in calls:
                _, outcome = self._outcome(calls[ref], ref)
                outcomes[calls[ref]] = outcome if outcome is not None else Outcome(Fate.ANSWERED)
            else:
                try:
                    alive[probes[ref]] = Outcome.of_progress(ray.get(ref))
                except ray.exceptions.RayError as exc:  # the actor is gone: that is its outcome
                    outcomes[probes[ref]] = self._outcome_of_death(probes[ref], exc)
            primary_known = primary_known or any(outcome.fate.primary for outcome in outcomes.values())
        for rank in pending:
            outcomes.setdefault(rank, alive.get(rank, Outcome(Fate.SILENT)))
        return outcomes

    def _probe(self, rank: int) -> Any:
        try:
            return self._actors[rank].progress.remote()
        except Exception:  # Ray refused the call: the actor handle is gone
            return None

    def _outcome_of_death(self, rank: int, exc: BaseException) -> Outcome:
        return Outcome(Fate.DIED, death_cause(str(exc)), "", *self._whereabouts(rank))

    def _whereabouts(self, rank: int) -> tuple[str, int | None]:
        """The node address and process id of ``rank`` (unknown before the ranks joined)."""
        if rank >= len(self._processes):
            return "", None
        return self._node_ips[rank], self._processes[rank][1]

    # --- hangs -----------------------------------------------------------------------------------

    @property
    def _poll_s(self) -> float:
        return poll_interval_s(self._timeout_s)

    def _check_progress(self, function: str, started: float) -> None:
        """After the timeout, fail the call when a rank stopped answering or ranks wait in one collective too long."""
        waited = time.monotonic() - started
        if waited < self._timeout_s or not self._processes:  # not before every rank has joined (slow starts)
            return
        reports = self._progress_reports()
        frozen = any(report is None for report in reports.values())
        stuck = any(g.waiting_s >= self._timeout_s for r in reports.values() if r is not None for g in r.waiting_in())
        if frozen or stuck:
            self._fail_hung(function, waited, reports=reports)

    def _progress_reports(self) -> dict[int, RankProgress | None]:
        """Every rank's progress; None for a rank that did not answer within ``PROGRESS_ANSWER_S``."""
        refs = {rank: actor.progress.remote() for rank, actor in enumerate(self._actors)}
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=PROGRESS_ANSWER_S)
        answered = set(ready)
        reports: dict[int, RankProgress | None] = {}
        for rank, ref in refs.items():
            try:
                reports[rank] = ray.get(ref) if ref in answered else None
            except ray.exceptions.RayError:
                reports[rank] = None
        return reports

    def _fail_hung(
        self,
        function: str,
        waited: float,
        reported: tuple[int, RankFailure] | None = None,
        reports: dict[int, RankProgress | None] | None = None,
    ) -> NoReturn:
        diagnosis = diagnose(function, reports or self._progress_reports(), self.topology, waited)
        message = diagnosis.message
        traceback = ""
        if reported is not None:
            rank, failure = reported
            label = self.topology.ranks[rank].label() if self.topology is not None else f"rank {rank}"
            message += f" {label} reported: {failure.error_type}: {_first_line_of(failure.message)}"
            traceback = failure.traceback
        message += " Every rank actor and the placement group were released."
        logger.error("%s", message)
        self.shutdown()
        culprit = diagnosis.culprits[0] if diagnosis.culprits else -1
        raise RankHangError(message, culprit, function, traceback, diagnosis)

    # --- life cycle -----------------------------------------------------------------------------

    @property
    def is_alive(self) -> bool:
        return self._placement is not None

    def __enter__(self) -> RayRankGroup:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        state = "running" if self.is_alive else "shut down"
        return f"RayRankGroup(world_size={self._world_size}, {state})"

    def shutdown(self) -> None:
        """Kill every rank actor and free the placement group. Safe to call any number of times."""
        placement, self._placement = self._placement, None
        if placement is None:
            return
        if not ray.is_initialized():  # Ray already shut down (its actors with it); a call would start a new one
            self._actors = []
            return
        for actor in self._actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception as exc:  # an already-dead actor or a Ray that is shutting down
                logger.debug("ignoring error while killing a rank actor: %s", exc)
        self._actors = []
        try:
            placement.remove()
        except Exception as exc:  # Ray already shut down (e.g. at interpreter exit)
            logger.debug("ignoring error while removing the placement group: %s", exc)
        _end_local_processes(self._processes)


def _end_local_processes(processes: Sequence[tuple[str, int]]) -> None:
    """SIGKILL this node's rank processes that are stopped (SIGSTOP, a debugger): ``ray.kill`` cannot end a process
    that does not run, while a running one ends by it, so no shutdown waits on the others."""
    try:
        here = ray.get_runtime_context().get_node_id()
    except Exception:  # Ray is gone: nothing to ask
        return
    for node, pid in processes:
        if node == here and _is_stopped(pid):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


def _is_stopped(pid: int) -> bool:
    """Whether ``pid`` is stopped (state ``T``/``t`` in ``/proc``; False where there is no such file)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            state = stat.read().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return False
    return state in ("T", "t")


def _first_line_of(text: str) -> str:
    text = text.strip()
    return text.splitlines()[0] if text else ""
