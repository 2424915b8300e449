"""Naming the rank(s) where a failed call began, from what every rank's call came to (pure, like ``hang.py``).

When a rank dies, its peers' collectives fail within milliseconds, each with its own transport error,
and which error reaches the driver first is a race. So the driver does not blame the first error it
sees: it collects every rank's outcome for a short bounded grace (:mod:`actors.group`) and sorts them::

    primary     DIED       Ray reports the process gone (SIGKILL, a crash, an OOM kill, its node lost)
                RAISED     the rank's own code raised (a bug, bad data, CUDA out of memory)
    secondary   LOST_PEER  a collective failed because a member went away
                WAITING    still running, answering: in a collective that will never finish, or busy
                SILENT     neither finished nor answered within the grace
                ANSWERED   finished its call normally

The first line of the message names the primary ranks, their coordinates, node and cause, then
what the others saw::

    rank 1 (fsdp=1, ...) died in train_step: its process exited without a word (killed: SIGKILL, the
    kernel's OOM killer; or crashed) on node 10.0.0.2 (pid 4242); rank 0 (...) lost its peer in
    all_reduce on the fsdp sub-mesh
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from raymoe.rank.contract import MESH_PREFIX, FailureKind, RankFailure, RankProgress
from raymoe.spec.topology import Topology


class Fate(enum.Enum):
    """What one rank's call came to (see the module docstring)."""

    DIED = "died"
    RAISED = "raised"
    LOST_PEER = "lost its peer"
    TIMED_OUT = "timed out"
    WAITING = "waiting"
    SILENT = "silent"
    ANSWERED = "answered"

    @property
    def primary(self) -> bool:
        return self in (Fate.DIED, Fate.RAISED)


@dataclass(frozen=True)
class Outcome:
    """One rank's fate, with what explains it: ``detail`` (a death's cause, an exception's ``Type: message``, or
    where a waiting rank waits), ``traceback`` (of an exception), ``node`` / ``pid`` (where the process ran)."""

    fate: Fate
    detail: str = ""
    traceback: str = ""
    node: str = ""
    pid: int | None = None

    @classmethod
    def of_failure(cls, failure: RankFailure, node: str = "", pid: int | None = None) -> Outcome:
        """A rank function's exception: its own (RAISED), or a collective's (LOST_PEER, TIMED_OUT)."""
        fate = {FailureKind.RAISED: Fate.RAISED, FailureKind.LOST_PEER: Fate.LOST_PEER}.get(
            failure.kind, Fate.TIMED_OUT
        )
        detail = f"{failure.error_type}: {_first_line(failure.message)}"
        progress = failure.progress
        if fate is not Fate.RAISED:  # where the collective broke, or else the transport's words
            detail = _collectives(progress) if progress is not None and progress.waiting_in() else f"({detail})"
        return cls(fate, detail, failure.traceback, node, pid)

    @classmethod
    def of_progress(cls, report: RankProgress) -> Outcome:
        """A rank still in its call that answered its monitor: where it waits, or what it runs."""
        if report.waiting_in():
            return cls(Fate.WAITING, _collectives(report))
        doing = f"running {report.function}, in no collective" if report.function else "between calls"
        return cls(Fate.WAITING, doing)


@dataclass(frozen=True)
class Blame:
    """The primary ranks (where the failure began; empty when none could be named), the others' fates, the
    message (its first line names the primary ranks) and the traceback of the first primary that raised."""

    primary: tuple[int, ...]
    secondary: tuple[int, ...]
    message: str
    traceback: str
    traceback_rank: int | None = None  # whose traceback it is


def death_cause(error_text: str) -> str:
    """Ray's words on a dead rank actor, in short: what ended the process, as far as Ray knows."""
    text = error_text.lower()
    if "memory monitor" in text or "out of memory" in text or "outofmemory" in text:
        return "killed by Ray's memory monitor (the node ran out of memory)"
    if "node" in text and ("died" in text or "dead" in text) and "worker process has died" not in text:
        return "its node was lost"
    if "ray.kill" in text or "killed by ray.kill" in text:
        return "killed by ray.kill"
    if "exit_actor" in text or "intended" in text:
        return "its process exited (intended exit)"
    return "its process exited without a word (killed: SIGKILL, the kernel's OOM killer; or crashed)"


def assign_blame(function: str, outcomes: Mapping[int, Outcome], topology: Topology | None) -> Blame:
    """Sort ``outcomes`` (every rank of the call) into primary and secondary and say it, primary first."""
    primary = tuple(sorted(rank for rank, o in outcomes.items() if o.fate.primary))
    secondary = tuple(sorted(rank for rank, o in outcomes.items() if not o.fate.primary))
    clauses = [_primary_clause(rank, outcomes[rank], function, topology) for rank in primary]
    if not primary:
        clauses.append(f"no rank was seen failing first in {function}")
    for fate in (Fate.LOST_PEER, Fate.TIMED_OUT, Fate.WAITING, Fate.SILENT):
        ranks = [rank for rank in secondary if outcomes[rank].fate is fate]
        if ranks:
            clauses.append(_secondary_clause(fate, ranks, outcomes, topology))
    message = "; ".join(clauses)
    explained = [rank for rank in (*primary, *secondary) if outcomes[rank].traceback]
    if not explained:
        return Blame(primary, secondary, message, "")
    return Blame(primary, secondary, message, outcomes[explained[0]].traceback, explained[0])


def _primary_clause(rank: int, outcome: Outcome, function: str, topology: Topology | None) -> str:
    where = f" on node {outcome.node}" if outcome.node else ""
    if outcome.pid is not None:
        where += f" (pid {outcome.pid})"
    if outcome.fate is Fate.DIED:
        return f"{_label(rank, topology)} died in {function}: {outcome.detail}{where}"
    return f"{_label(rank, topology)} failed in {function}: {outcome.detail}"


def _secondary_clause(
    fate: Fate, ranks: Sequence[int], outcomes: Mapping[int, Outcome], topology: Topology | None
) -> str:
    who = ", ".join(_label(rank, topology) for rank in ranks)
    details = list(dict.fromkeys(outcomes[rank].detail for rank in ranks if outcomes[rank].detail))
    said = f" {'; '.join(details)}" if details else ""
    if fate is Fate.LOST_PEER:
        return f"{who} lost {'its peer' if len(ranks) == 1 else 'their peer'}{said}"
    if fate is Fate.TIMED_OUT:
        return f"{who} timed out{said}"
    if fate is Fate.WAITING:
        return f"{who} still running ({'; '.join(details) or 'in no collective'})"
    return f"{who} did not answer"


def _collectives(report: RankProgress) -> str:
    """``in all_reduce on the fsdp sub-mesh``: the collectives a rank entered and did not finish."""
    return "in " + ", ".join(f"{g.op or 'a collective'} on the {_axis(g.desc)} sub-mesh" for g in report.waiting_in())


def _label(rank: int, topology: Topology | None) -> str:
    return topology.ranks[rank].label() if topology is not None else f"rank {rank}"


def _axis(desc: str) -> str:
    return desc.removeprefix(MESH_PREFIX) if desc.startswith(MESH_PREFIX) else desc or "world"


def _first_line(text: str) -> str:
    text = text.strip()
    return text.splitlines()[0] if text else ""
