"""A rank's progress from torch's flight recorders: NCCL's own recorder (a canned dump, as a CUDA build writes it) and
the generic one (a real gloo world in this process), read through the functions that read them on a rank.

The canned document has the fields of ``FlightRecorder<EventType>::dump_json`` (torch/csrc/distributed/c10d/
FlightRecorderDetail.hpp), which ``_dump_nccl_trace_json`` calls on ``FlightRecorderCUDA`` and ``_dump_fr_trace_json``
on ``FlightRecorder<c10::Event>``; the gloo dump of this build (read in the last test) has the same keys.
"""

from __future__ import annotations

import json
import time

import pytest
import torch
import torch.distributed as dist

from raymoe import DistributedConfig, build_topology
from raymoe.rank.contract import GroupProgress
from raymoe.rank.local import LocalRankGroup
from raymoe.rank.progress import (
    GENERIC_DUMP,
    NCCL_DUMP,
    CallRecord,
    collective_groups,
    progress_report,
    recorder_dumps,
    recorder_groups,
    recorder_names,
)


def _entry(record_id, pg_id, group, seq, op, created_ns, state, backend="nccl"):
    """One entry of the recorder's ``entries``, every field ``dump_json`` writes."""
    return {
        "record_id": record_id,
        "pg_id": pg_id,
        "process_group": list(group),
        "thread_name": "pt_main_thread",
        "thread_id": "140245071234560",
        "collective_seq_id": seq,
        "p2p_seq_id": 0,
        "op_id": seq,
        "profiling_name": f"{backend}:{op}",
        "time_created_ns": created_ns,
        **({"duration_ms": 0.41} if state == "completed" else {}),
        "input_sizes": [[4096, 2048]],
        "input_dtypes": ["BFloat16"],
        "output_sizes": [[4096, 2048]],
        "output_dtypes": ["BFloat16"],
        "state": state,
        "time_discovered_started_ns": created_ns + 1000 if state != "scheduled" else 0,
        "time_discovered_completed_ns": created_ns + 500_000 if state == "completed" else 0,
        "retired": state == "completed",
        "timeout_ms": 360000,
        "is_p2p": False,
    }


def nccl_trace(now_ns: int) -> dict:
    """Rank 0 of a tp2 x fsdp2 world on NCCL: its tp group ("3", pg_id 1) waits in all_reduce #17 for 41 s."""
    world, tp = ("0", "default_pg"), ("3", "mesh_tp")
    return {
        "version": "2.10",
        "comm_lib_version": "2.27.5",
        "pg_config": {
            "0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1, 2, 3]"},
            "3": {"name": "3", "desc": "mesh_tp", "ranks": "[0, 1]"},
        },
        "pg_status": {
            "0": {"last_enqueued_collective": "5", "last_started_collective": "-1", "last_completed_collective": "5"},
            "1": {"last_enqueued_collective": "17", "last_started_collective": "-1", "last_completed_collective": "16"},
        },
        "entries": [
            _entry(0, 0, world, 5, "all_reduce", now_ns - 90_000_000_000, "completed"),
            _entry(1, 1, tp, 16, "_reduce_scatter_base", now_ns - 42_000_000_000, "completed"),
            _entry(2, 1, tp, 17, "all_reduce", now_ns - 41_000_000_000, "started"),
        ],
        "nccl_comm_state": {},
    }


def gloo_trace(now_ns: int) -> dict:
    """The generic recorder of the same rank: the gloo checkpoint group ("9"), which numbers itself pg_id 0 there."""
    return {
        "version": "2.10",
        "comm_lib_version": "",
        "pg_config": {"9": {"name": "9", "desc": "undefined", "ranks": "[0, 1, 2, 3]"}},
        "pg_status": {
            "0": {"last_enqueued_collective": "2", "last_started_collective": "-1", "last_completed_collective": "2"}
        },
        "entries": [_entry(0, 0, ("9", "undefined"), 2, "barrier", now_ns - 60_000_000_000, "completed", "gloo")],
        "nccl_comm_state": {},
    }


def dump_of(document: dict):
    """A dump function answering ``document`` the way torch's do: JSON bytes for (includeCollectives, onlyActive)."""

    def dump(include_collectives: bool | None = None, only_active: bool | None = None) -> bytes:
        assert include_collectives is True and only_active is False
        return json.dumps(document).encode()

    return dump


def test_the_nccl_recorder_names_the_collective_a_group_waits_in():
    groups = recorder_groups(dump_of(nccl_trace(time.time_ns())))
    by_name = {group.name: group for group in groups}
    assert set(by_name) == {"0", "3"}
    assert by_name["0"] == GroupProgress("0", "default_pg", 5, 5, "all_reduce", 0.0)
    tp = by_name["3"]
    assert (tp.name, tp.desc, tp.entered, tp.finished, tp.op) == ("3", "mesh_tp", 17, 16, "all_reduce")
    assert tp.waiting and tp.waiting_s == pytest.approx(41.0, abs=5.0)


def test_both_recorders_merge_though_they_number_their_groups_alike():
    now = time.time_ns()
    groups = collective_groups([dump_of(nccl_trace(now)), dump_of(gloo_trace(now))])
    by_name = {group.name: group for group in groups}
    assert set(by_name) == {"0", "3", "9"} and len(groups) == 3
    # pg_id 0 is the NCCL world in one recorder and the gloo checkpoint group in the other
    assert (by_name["0"].desc, by_name["0"].entered) == ("default_pg", 5)
    assert (by_name["9"].desc, by_name["9"].entered, by_name["9"].op) == ("undefined", 2, "barrier")
    assert by_name["3"].waiting


def test_a_group_in_both_recorders_is_read_once_from_the_first():
    now = time.time_ns()
    groups = collective_groups([dump_of(nccl_trace(now)), dump_of(nccl_trace(now))])
    assert sorted(group.name for group in groups) == ["0", "3"]


def test_an_unreadable_recorder_adds_nothing():
    def broken(*_args):
        raise RuntimeError("no process group")

    assert recorder_groups(broken) == []
    assert recorder_groups(lambda *_: b"{}") == []
    now = time.time_ns()
    assert {g.name for g in collective_groups([broken, dump_of(gloo_trace(now))])} == {"9"}


def test_nccl_ranks_read_the_nccl_recorder_first_and_gloo_ranks_the_generic_one():
    assert recorder_names("nccl") == ("_dump_nccl_trace_json", "_dump_fr_trace_json") == (NCCL_DUMP, GENERIC_DUMP)
    assert recorder_names("gloo") == recorder_names(None) == ("_dump_fr_trace_json",)
    import torch._C._distributed_c10d as c10d

    generic = getattr(c10d, GENERIC_DUMP)
    assert recorder_dumps("gloo") == [generic]
    # a build without NCCL (this CPU one) has no NCCL recorder to read; a CUDA build has both
    assert recorder_dumps("nccl") == [getattr(c10d, name) for name in (NCCL_DUMP, GENERIC_DUMP) if hasattr(c10d, name)]


def _all_reduce_twice(ctx):
    for _ in range(2):
        dist.all_reduce(torch.ones(4))
    return progress_report(ctx.rank, CallRecord(), ctx.backend)


def test_a_gloo_rank_reports_its_collectives_from_the_generic_recorder():
    group = LocalRankGroup()
    try:
        group.use_layout(build_topology(DistributedConfig(), 1))
        (report,) = group.execute(_all_reduce_twice)
    finally:
        group.shutdown()
    # the recorder is the process's: worlds an earlier test of this process started (and ended) are in it too
    world = [g for g in report.groups if g.desc == "default_pg" and g.op == "all_reduce"]
    # gloo marks a collective finished from its own thread, a moment after the caller has its result
    assert any(g.entered >= 2 and g.finished >= g.entered - 1 for g in world), report.groups
