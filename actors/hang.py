"""Naming the ranks a stuck call waits for, from every rank's :class:`~raymoe.rank.progress.RankProgress`.

A collective finishes only when every member of its group has entered it. When a call hangs, the ranks
that answer say which collective they wait in (group, sequence number, op); the culprits are the members
of that group that either did not answer at all (the process is frozen: SIGSTOP, a debugger, a machine
swapping) or answered but never entered that collective (stuck elsewhere: a storage read, a loop, a
collective on another group). A rank behind in one group while it leads another stalled one is a victim,
not a culprit: it waits for someone too. A rank reports its layout's groups as ``mesh_<axis>`` (``mesh_tp/ep`` where
two axes group the same ranks; ``mesh_fsdp_cp``, FSDP2's group under cp), so the members of a rank's group are its
ranks along that axis of the layout; a group of an earlier layout names its ranks (``ranks_0_3``); any other group
(the world's, the checkpoint group) spans every rank. How soon the driver reads the reports of a stuck call (its
poll, the answer wait: :func:`diagnosis_deadline_s`) is kept here too, since a backend that ends a rank at its own
timeout must wait longer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from raymoe.rank.contract import MESH_PREFIX, GroupProgress, RankProgress, rank_set_of
from raymoe.spec.topology import FSDP_CP, Axis, Topology

PROGRESS_ANSWER_S = 5.0  # how long a rank gets to answer a progress request before it counts as frozen


def poll_interval_s(timeout_s: float) -> float:
    """How often the driver's watchdog (``actors/group.py``) looks at a call running under ``timeout_s``."""
    return min(5.0, max(timeout_s / 4, 0.5))


def diagnosis_deadline_s(timeout_s: float) -> float:
    """The latest time, after a collective began, by which the driver holds every rank's report of it: the
    collective timeout, then at most one poll, then at most one answer wait. A backend that ends a rank's process at
    its own timeout (NCCL's watchdog) must wait longer (``raymoe.rank.context.backend_timeout_s``)."""
    return timeout_s + poll_interval_s(timeout_s) + PROGRESS_ANSWER_S


@dataclass(frozen=True)
class Waiting:
    """Ranks blocked in one collective: the group (its name and sub-mesh), the collective's number and op."""

    group: str
    axis: str
    seq: int
    op: str
    ranks: tuple[int, ...]
    waited_s: float


@dataclass(frozen=True)
class Diagnosis:
    """Who stopped the call: ``frozen`` ranks did not answer; ``absent`` ranks answered but never entered the
    collective others wait in; ``waiting`` lists those collectives. ``message`` says it in one paragraph."""

    frozen: tuple[int, ...]
    absent: tuple[int, ...]
    waiting: tuple[Waiting, ...]
    message: str

    @property
    def culprits(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.frozen) | set(self.absent)))


def diagnose(
    function: str,
    reports: Mapping[int, RankProgress | None],
    topology: Topology | None,
    waited_s: float,
) -> Diagnosis:
    """Read the per-rank reports (None: that rank did not answer) of a call to ``function`` stuck for ``waited_s``.

    Works from how many collectives each member entered on each group, so it also reads ranks whose own collective
    already timed out. A group is stalled when a member is behind the others (or frozen). Members behind in a
    stalled group are the culprits, unless they lead another stalled group (then they wait for someone too).
    """
    everyone = sorted(reports)
    frozen = tuple(rank for rank in everyone if reports[rank] is None)
    stalled = _stalled(reports, topology, everyone, set(frozen))
    leading = {rank for blocked, _ in stalled for rank in blocked.ranks}
    behind = sorted({rank for _, late in stalled for rank in late})
    stuck_elsewhere = tuple(rank for rank in behind if rank not in leading)
    absent = stuck_elsewhere if (stuck_elsewhere or frozen) else tuple(behind)
    waiting = tuple(blocked for blocked, _ in stalled)
    message = _message(function, reports, topology, waited_s, frozen, absent, waiting)
    return Diagnosis(frozen, absent, waiting, message)


def _stalled(
    reports: Mapping[int, RankProgress | None], topology: Topology | None, everyone: list[int], frozen: set[int]
) -> list[tuple[Waiting, tuple[int, ...]]]:
    """Each stalled collective (who entered it) with the answering members that never entered it."""
    seen: dict[str, GroupProgress] = {}
    for report in reports.values():
        for group in report.groups if report is not None else ():
            seen.setdefault(group.name, group)
    found = []
    for name, group in seen.items():
        members = _members(group.desc, topology, everyone, _reporters(reports, name))
        entered = {rank: _entered(reports[rank], name) for rank in members if rank not in frozen}
        if not entered:
            continue
        seq = max(entered.values())
        late = tuple(rank for rank, count in entered.items() if count < seq)
        leaders = tuple(rank for rank, count in entered.items() if count == seq)
        if seq == 0 or not (late or frozen & set(members) or _any_waiting(reports, leaders, name)):
            continue
        op, waited = _op_and_wait(reports, leaders, name)
        found.append((Waiting(name, _axis(group.desc), seq, op, leaders, waited), late))
    return found


def _reporters(reports: Mapping[int, RankProgress | None], name: str) -> list[int]:
    return [
        rank for rank, report in reports.items() if report is not None and any(g.name == name for g in report.groups)
    ]


def _any_waiting(reports: Mapping[int, RankProgress | None], ranks: tuple[int, ...], name: str) -> bool:
    return any(g.waiting for rank in ranks for g in _groups_named(reports[rank], name))


def _op_and_wait(reports: Mapping[int, RankProgress | None], ranks: tuple[int, ...], name: str) -> tuple[str, float]:
    groups = [g for rank in ranks for g in _groups_named(reports[rank], name)]
    return next((g.op for g in groups if g.op), ""), max((g.waiting_s for g in groups), default=0.0)


def _groups_named(report: RankProgress | None, name: str) -> list[GroupProgress]:
    return [g for g in report.groups if g.name == name] if report is not None else []


def _axis(desc: str) -> str:
    return desc.removeprefix(MESH_PREFIX) if desc.startswith(MESH_PREFIX) else desc or "unnamed"


def _members(
    desc: str, topology: Topology | None, everyone: Sequence[int], reporters: Sequence[int]
) -> tuple[int, ...]:
    """The ranks of a group: those its description names (``ranks_0_3``), those along its axis of the layout (found
    from a rank that reported it; ``tp/ep``: the axes group the same ranks), or every rank."""
    named = rank_set_of(desc)
    if named is not None:
        return named
    if topology is None or not reporters or not desc.startswith(MESH_PREFIX):
        return tuple(everyone)
    return _axis_group(topology, reporters[0], _axis(desc).split("/")[0]) or tuple(everyone)


def _axis_group(topology: Topology, rank: int, axis: str) -> tuple[int, ...] | None:
    if axis == FSDP_CP:  # FSDP2's dense shard group under context parallelism: fsdp and cp flattened
        return tuple(sorted(m for c in topology.group_of(rank, Axis.CP) for m in topology.group_of(c, Axis.FSDP)))
    if axis in {a.value for a in Axis}:
        return topology.group_of(rank, Axis(axis))
    return None


def _entered(report: RankProgress | None, group_name: str) -> int:
    return max((g.entered for g in _groups_named(report, group_name)), default=0)


def _label(rank: int, topology: Topology | None) -> str:
    return topology.ranks[rank].label() if topology is not None else f"rank {rank}"


def _ranks(ranks: Sequence[int], topology: Topology | None) -> str:
    return ", ".join(_label(rank, topology) for rank in ranks)


def _message(
    function: str,
    reports: Mapping[int, RankProgress | None],
    topology: Topology | None,
    waited_s: float,
    frozen: tuple[int, ...],
    absent: tuple[int, ...],
    waiting: tuple[Waiting, ...],
) -> str:
    lines = [f"{function} made no progress for {waited_s:.0f} s."]
    if frozen:
        lines.append(
            f"{_ranks(frozen, topology)} stopped responding: its process does not answer (frozen or stopped: "
            "SIGSTOP, a debugger, a machine out of memory or swapping)."
        )
    for rank in absent:
        report = reports[rank]
        assert report is not None
        doing = f"running {report.function}" if report.function else "between calls"
        elsewhere = [f"{g.op} #{g.entered} on {_axis(g.desc)}" for g in report.waiting_in()]
        where = f", waiting in {', '.join(elsewhere)}" if elsewhere else ", in no collective"
        lines.append(f"{_label(rank, topology)} never reached the collective its group waits in ({doing}{where}).")
    for blocked in waiting:
        lines.append(
            f"{_ranks(blocked.ranks, topology)} waited {blocked.waited_s:.0f} s in {blocked.op or 'a collective'} "
            f"#{blocked.seq} on the {blocked.axis} sub-mesh."
        )
    if not frozen and not absent:
        lines.append("No rank could be named: every rank answered and none is missing from a collective.")
    return " ".join(lines)
