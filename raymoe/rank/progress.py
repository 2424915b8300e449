"""What a rank is doing right now, readable while it is stuck: the rank function it runs and its collectives.

The rank actor answers :func:`progress_report` from a thread of its own, so the driver can ask while the
rank's main thread waits in a collective (or learn, by getting no answer, that the process stopped). The
collectives come from torch's flight recorders (enabled in :func:`raymoe.rank.context.join_world`): for
every process group, how many collectives this rank has entered and finished, and the one it waits in::

    rank 0   tp group "3"   entered 17, finished 16, waiting in #17 all_reduce (for 41 s)
    rank 1   tp group "3"   entered 16, finished 16                 <- never arrived at #17

torch keeps two recorders, one JSON format (``FlightRecorder<EventType>::dump_json``): the generic one
(``_dump_fr_trace_json``, ``FlightRecorder<c10::Event>``) records gloo's groups; ProcessGroupNCCL records into its
own (``_dump_nccl_trace_json``, ``FlightRecorder<at::cuda::CUDAEvent>``, built only with NCCL), so under NCCL both
are read (:func:`recorder_dumps`) and their groups merged (:func:`collective_groups`).

The driver (:mod:`actors.hang`) reads the reports of all ranks against the layout and names
the ranks the others wait for.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from raymoe.rank.contract import GroupProgress, RankProgress, WorldBackend

# TORCH_FR_BUFFER_SIZE: recent collectives kept per recorder; both recorders read it (FlightRecorder's constructor,
# shared by both; its older name TORCH_NCCL_TRACE_BUFFER_SIZE is deprecated and warns)
FLIGHT_RECORDER_ENTRIES = "2000"
NCCL_DUMP = "_dump_nccl_trace_json"  # ProcessGroupNCCL's recorder (torch._C._distributed_c10d, CUDA builds only)
GENERIC_DUMP = "_dump_fr_trace_json"  # the generic recorder: gloo's groups (the checkpoint group under NCCL too)

Dump = Callable[..., bytes | str]  # a recorder's JSON dump: (includeCollectives, onlyActive) -> JSON


@dataclass
class CallRecord:
    """Kept by the rank actor: the rank function it runs now, and since when (``time.monotonic``)."""

    function: str | None = None
    since: float = 0.0


def progress_report(
    rank: int, call: CallRecord, backend: WorldBackend | None = None, descs: Mapping[str, str] | None = None
) -> RankProgress:
    """This rank's :class:`RankProgress`, from ``call`` and the recorders of ``backend`` (None: not joined yet; no
    collective, no GIL-heavy work); ``descs`` renames group descriptions (a layout's rank sets by their axes:
    :func:`raymoe.rank.groups.axis_descs`)."""
    running = time.monotonic() - call.since if call.function is not None else 0.0
    groups = collective_groups(recorder_dumps(backend))
    if descs:
        groups = [replace(group, desc=descs.get(group.desc, group.desc)) for group in groups]
    return RankProgress(rank, call.function, running, tuple(groups))


def recorder_names(backend: WorldBackend | None) -> tuple[str, ...]:
    """Pure: the dump functions (of ``torch._C._distributed_c10d``) of the recorders holding ``backend``'s
    collectives: NCCL's own first under NCCL, then the generic one (gloo's groups: the checkpoint group under NCCL)."""
    return (NCCL_DUMP, GENERIC_DUMP) if backend == "nccl" else (GENERIC_DUMP,)


def recorder_dumps(backend: WorldBackend | None) -> list[Dump]:
    """The dump functions of :func:`recorder_names` that this torch build has."""
    try:
        import torch._C._distributed_c10d as c10d
    except ImportError:  # a torch without distributed
        return []
    return [getattr(c10d, name) for name in recorder_names(backend) if hasattr(c10d, name)]


def collective_groups(dumps: Iterable[Dump]) -> list[GroupProgress]:
    """The groups of every recorder in ``dumps``, each recorder parsed on its own (``pg_id`` numbers a recorder's
    groups, so two recorders reuse them); a group name already seen in an earlier recorder is skipped (a torch that
    records NCCL's collectives in both)."""
    groups: list[GroupProgress] = []
    for dump in dumps:
        seen = {group.name for group in groups}
        groups.extend(group for group in recorder_groups(dump) if group.name not in seen)
    return groups


def recorder_groups(dump: Dump) -> list[GroupProgress]:
    """The groups of one recorder, read through its ``dump`` function; none when it cannot be read (no process group
    yet, a torch without the recorder)."""
    try:
        trace = json.loads(dump(True, False))  # includeCollectives, onlyActive
    except Exception:
        return []
    return parse_trace(trace, time.time_ns())


def parse_trace(trace: Mapping[str, Any], now_ns: int) -> list[GroupProgress]:
    """Pure: the groups of one recorder's JSON document (``entries``, ``pg_status``), their waits measured at
    ``now_ns`` (``time.time_ns``)."""
    named: dict[str, tuple[str, str]] = {}  # pg_id -> (name, desc)
    ops: dict[tuple[str, int], tuple[str, int]] = {}  # (pg_id, seq) -> (op, created ns)
    for entry in trace.get("entries", []):
        pg_id = str(entry.get("pg_id"))
        name, desc = ([*list(entry.get("process_group") or ["", ""]), "", ""])[:2]
        named[pg_id] = (str(name), str(desc))
        profiling = str(entry.get("profiling_name", ""))
        op = profiling.partition(":")[2] or profiling  # "nccl:all_reduce" -> "all_reduce"
        ops[(pg_id, int(entry.get("collective_seq_id", 0)))] = (op, int(entry.get("time_created_ns", 0)))
    groups = []
    for pg_id, status in trace.get("pg_status", {}).items():
        if pg_id not in named:
            continue
        entered = max(int(status.get("last_enqueued_collective", 0)), 0)
        finished = max(int(status.get("last_completed_collective", 0)), 0)
        op, created = ops.get((pg_id, entered), ("", 0))
        waiting = (now_ns - created) / 1e9 if entered > finished and created else 0.0
        groups.append(GroupProgress(*named[pg_id], entered, finished, op, waiting))
    return groups
