"""Whether a rank function's exception began in that rank or in a peer it lost, from the transport's own words."""

import pytest
import torch.distributed as dist

from raymoe.rank.contract import FailureKind, GroupProgress, RankProgress
from raymoe.rank.failure import failure_kind, rank_failure

GLOO = "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:61327: "


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        (RuntimeError(GLOO + "Connection reset by peer. This is typically caused by a remote worker hanging"), "lost"),
        (RuntimeError("[gloo] Connection closed by peer [127.0.0.1]:4242"), "lost"),
        (dist.DistBackendError("NCCL communicator was aborted on rank 3"), "lost"),
        (dist.DistNetworkError("failed to recv, got 0 bytes"), "lost"),
        (
            RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 15000ms for recv operation"),
            "time",
        ),
        (dist.DistStoreError("Timed out after 300 seconds waiting for clients. 3/4 clients joined."), "time"),
        (ValueError("labels must be token ids in [0, 96)"), "own"),
        (ConnectionResetError("Connection reset by peer"), "own"),  # the rank's own socket (a hub download), not gloo
        (TimeoutError("the hub did not answer: timed out"), "own"),
        (MemoryError(), "own"),
    ],
)
def test_failure_kinds(error, kind):
    expected = {"lost": FailureKind.LOST_PEER, "time": FailureKind.TIMED_OUT, "own": FailureKind.RAISED}[kind]
    assert failure_kind(error) is expected


def test_the_cause_of_a_wrapped_error_counts():
    try:
        try:
            raise RuntimeError("[gloo] Connection closed by peer")
        except RuntimeError as inner:
            raise RuntimeError("backward failed") from inner
    except RuntimeError as outer:
        failure = rank_failure(
            outer, RankProgress(1, "train_step", 2.0, (GroupProgress("0", "mesh_fsdp", 3, 2, "all_gather"),))
        )
    assert failure.kind is FailureKind.LOST_PEER and failure.error_type == "RuntimeError"
    assert "Connection closed by peer" in failure.traceback and failure.progress.waiting_in()[0].op == "all_gather"
