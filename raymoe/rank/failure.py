"""What a rank function's exception says about where a failure began: in this rank, or in a peer it lost.

When one rank dies, the others' collectives fail too, each with an error of its own transport. Those
are consequences, not causes; the driver (``actors/blame.py``) must name the rank that failed first::

    rank 1   SIGKILL                                   (no answer: Ray reports the actor died)
    rank 0   RuntimeError: [gloo] ... Connection reset by peer          -> LOST_PEER
    rank 2   RuntimeError: [gloo] ... Connection closed by peer         -> LOST_PEER
    rank 3   ValueError: labels must be ...                             -> RAISED

Classified by the exception's type (torch's ``DistNetworkError`` / ``DistBackendError`` / ``DistStoreError``)
and, since gloo raises plain ``RuntimeError``, by the transport's wording (an error that names gloo, NCCL or
c10d), along the exception's chain. Anything else is the rank's own failure.
"""

from __future__ import annotations

import re
import traceback

from raymoe.rank.contract import FailureKind, RankFailure, RankProgress

# What gloo, NCCL and torch's store say when the other end of a connection went away.
_LOST_PEER_TEXT = re.compile(
    r"connection (?:closed|reset) by peer|broken pipe|socket closed|connection refused|"
    r"remote process exited|communicator was aborted|ncclRemoteError|failed to recv, got 0 bytes",
    re.IGNORECASE,
)
# Where the transport's own errors come from (gloo's sources, NCCL, torch's c10d); a rank's own code rarely says so.
_TRANSPORT_TEXT = re.compile(r"gloo|nccl|c10d|ProcessGroup", re.IGNORECASE)
_TIMEOUT_TEXT = re.compile(r"timed? ?out|timeout", re.IGNORECASE)
_COMMUNICATION_TYPES = ("DistNetworkError", "DistBackendError", "DistStoreError")


def failure_kind(error: BaseException) -> FailureKind:
    """RAISED, LOST_PEER or TIMED_OUT for ``error`` (see the module docstring); its causes count too."""
    for link in _chain(error):
        text = str(link)
        if type(link).__name__ not in _COMMUNICATION_TYPES and not _TRANSPORT_TEXT.search(text):
            continue  # not the transport's error: a timeout or a closed connection of the rank's own code
        if _TIMEOUT_TEXT.search(text):
            return FailureKind.TIMED_OUT
        if _LOST_PEER_TEXT.search(text) or type(link).__name__ in _COMMUNICATION_TYPES:
            return FailureKind.LOST_PEER
    return FailureKind.RAISED


def rank_failure(error: BaseException, progress: RankProgress | None = None) -> RankFailure:
    """``error`` as the driver receives it: type, message, traceback, its kind and this rank's progress."""
    return RankFailure(
        type(error).__name__,
        str(error),
        "".join(traceback.format_exception(error)),
        failure_kind(error),
        progress,
    )


def _chain(error: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    current: BaseException | None = error
    while current is not None and current not in seen:
        seen.append(current)
        current = current.__cause__ or current.__context__
    return seen
