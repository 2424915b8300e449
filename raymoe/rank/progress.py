"""What a rank is doing right now, readable while it is stuck: the rank function it runs and its collectives.

The rank actor answers :func:`progress_report` from a thread of its own, so the driver can ask while the
rank's main thread waits in a collective (or learn, by getting no answer, that the process stopped). The
collectives come from torch's flight recorder (enabled in :func:`raymoe.rank.context.join_world`): for
every process group, how many collectives this rank has entered and finished, and the one it waits in::

    rank 0   tp group "3"   entered 17, finished 16, waiting in #17 all_reduce (for 41 s)
    rank 1   tp group "3"   entered 16, finished 16                 <- never arrived at #17

The driver (:mod:`actors.hang`) reads the reports of all ranks against the layout and names
the ranks the others wait for.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from raymoe.rank.contract import GroupProgress, RankProgress

FLIGHT_RECORDER_ENTRIES = "2000"  # TORCH_FR_BUFFER_SIZE: recent collectives kept per process


@dataclass
class CallRecord:
    """Kept by the rank actor: the rank function it runs now, and since when (``time.monotonic``)."""

    function: str | None = None
    since: float = 0.0


def progress_report(rank: int, call: CallRecord) -> RankProgress:
    """This rank's :class:`RankProgress`, from ``call`` and the flight recorder (no collective, no GIL-heavy work)."""
    running = time.monotonic() - call.since if call.function is not None else 0.0
    return RankProgress(rank, call.function, running, tuple(_groups()))


def _groups() -> list[GroupProgress]:
    try:
        import torch._C._distributed_c10d as c10d

        trace = json.loads(c10d._dump_fr_trace_json(includeCollectives=True))  # type: ignore[attr-defined]
    except Exception:  # no process group yet, or a torch without the flight recorder
        return []
    now_ns = time.time_ns()
    named: dict[str, tuple[str, str]] = {}  # pg_id -> (name, desc)
    ops: dict[tuple[str, int], tuple[str, int]] = {}  # (pg_id, seq) -> (op, created ns)
    for entry in trace.get("entries", []):
        pg_id = str(entry.get("pg_id"))
        name, desc = ([*list(entry.get("process_group") or ["", ""]), "", ""])[:2]
        named[pg_id] = (str(name), str(desc))
        op = str(entry.get("profiling_name", "")).partition(":")[2] or str(entry.get("profiling_name", ""))
        ops[(pg_id, int(entry.get("collective_seq_id", 0)))] = (op, int(entry.get("time_created_ns", 0)))
    groups = []
    for pg_id, status in trace.get("pg_status", {}).items():
        if pg_id not in named:
            continue
        entered = int(status.get("last_enqueued_collective", 0))
        finished = max(int(status.get("last_completed_collective", 0)), 0)
        op, created = ops.get((pg_id, entered), ("", 0))
        waiting = (now_ns - created) / 1e9 if entered > finished and created else 0.0
        groups.append(GroupProgress(*named[pg_id], entered, finished, op, waiting))
    return groups
