"""The handle's weight streaming (issue 31): hub-layout weights in buckets, to the driver or to a rollout engine.

Both walk the model as ``save_pretrained`` writes it, the same names and values (in the checkpoint's dtype, or
``dtype``), gathered on the ranks one bucket at a time (:mod:`raymoe.rank.weight_stream`)::

    iter_hub_weights(fanout)            start -> next, next, ... -> None      a bucket per call, through the driver
    push_weights(fanout, receivers)     one call: rank 0 sends each bucket    rank 0 -> object store -> receivers
                                        to every receiver itself

A bucket is ``[(hub name, full CPU tensor), ...]`` of about ``bucket_bytes``: closed once its bytes reach
``bucket_bytes`` or the next tensor would take it past them (a larger tensor is a bucket alone). Bad arguments fail
here, before any rank is asked.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from raymoe.driver.fanout import FanOut
from raymoe.rank.weight_stream import end_weight_stream, next_weight_bucket, push_hub_weights, start_weight_stream

DEFAULT_BUCKET_BYTES = 512 * 1024 * 1024

# The open iter_hub_weights stream of each model (its fan-out): a newer one replaces it on the ranks.
_OPEN: weakref.WeakKeyDictionary[FanOut, object] = weakref.WeakKeyDictionary()


def iter_hub_weights(
    fanout: FanOut, bucket_bytes: int = DEFAULT_BUCKET_BYTES, dtype: torch.dtype | None = None
) -> Iterator[list[tuple[str, Tensor]]]:
    """The model's hub tensors in buckets, in ``save_pretrained``'s order: ``[(hub name, full CPU tensor), ...]``.

    ``dtype``: None, the checkpoint's dtype (what ``save_pretrained`` writes); otherwise the floating weights in
    ``dtype`` (a float32 parameter of the model, a router's selection bias, stays float32, as when saving). The
    ranks gather each bucket when it is asked for: driver and ranks hold about one bucket, never the whole model.
    One stream per model at a time: starting another ends this one (whose next bucket is then an error). Closing
    the iterator early (``break``, ``close()``) ends the stream on the ranks.
    """
    check_stream_options(bucket_bytes, dtype)
    return _stream(fanout, bucket_bytes, dtype)


def push_weights(
    fanout: FanOut,
    receivers: Sequence[Any],
    method: str = "load_weights",
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    dtype: torch.dtype | None = None,
) -> dict[str, Any]:
    """Send every bucket of :func:`iter_hub_weights` to every receiver, from the ranks, never through the driver.

    ``receivers``: Ray actor handles whose method ``method`` takes one bucket ``[(hub name, tensor), ...]``; rank 0
    calls ``getattr(receiver, method).remote(bucket)`` on each (a copy per receiver in the object store) and
    returns once every receiver has applied the last bucket. A receiver's exception is one ``RuntimeError`` naming
    the receiver and the method (the model stays loaded; the receivers hold the buckets applied before).

    Returns ``{"buckets", "tensors", "bytes", "receivers", "seconds"}`` (``tensors`` and ``bytes`` per receiver;
    ``seconds`` on the driver, from the call to the last bucket applied).
    """
    check_stream_options(bucket_bytes, dtype)
    if isinstance(receivers, str | bytes) or not isinstance(receivers, Sequence):
        raise ValueError(
            f"push_weights: receivers must be a sequence of Ray actor handles, got {type(receivers).__name__}"
        )
    if not receivers:
        raise ValueError("push_weights: receivers is empty; pass at least one Ray actor handle to send the weights to")
    if not isinstance(method, str) or not method:
        raise ValueError(f"push_weights: method must be the name of the receivers' method, got {method!r}")
    missing = [index for index, receiver in enumerate(receivers) if not hasattr(receiver, method)]
    if missing:
        raise ValueError(
            f"push_weights: receivers {missing} (of {len(receivers)}) have no method {method!r}; each receiver must "
            f"be an actor handle whose {method}(bucket) takes a list of (hub name, tensor)"
        )
    start = time.perf_counter()
    answer = fanout.every_rank(push_hub_weights, list(receivers), method, bucket_bytes, dtype)[0]
    if answer.error is not None:
        raise RuntimeError(
            f"push_weights: {answer.error}, after {answer.buckets} bucket(s) sent; the model is still loaded, "
            f"and the receivers hold the buckets they applied before"
        )
    return {
        "buckets": answer.buckets,
        "tensors": answer.tensors,
        "bytes": answer.bytes,
        "receivers": len(receivers),
        "seconds": time.perf_counter() - start,
    }


def check_stream_options(bucket_bytes: object, dtype: object) -> None:
    """One ``ValueError`` naming the argument, its value and the rule."""
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be an int >= 1 (the bytes of a bucket), got {bucket_bytes!r}")
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(
            f"dtype must be a floating torch.dtype (e.g. torch.bfloat16) or None (the checkpoint dtype), got {dtype!r}"
        )


def _stream(fanout: FanOut, bucket_bytes: int, dtype: torch.dtype | None) -> Iterator[list[tuple[str, Tensor]]]:
    token = object()
    fanout.every_rank(start_weight_stream, bucket_bytes, dtype)
    _OPEN[fanout] = token
    done = False
    try:
        while True:
            if _OPEN.get(fanout) is not token:
                raise RuntimeError(
                    "this iter_hub_weights stream was ended by a newer one on the same model; iterate one at a time"
                )
            bucket = fanout.every_rank(next_weight_bucket)[0]
            if bucket is None:
                done = True
                return
            yield bucket
    finally:
        if _OPEN.get(fanout) is token:
            del _OPEN[fanout]
            if not done and _alive(fanout):
                fanout.every_rank(end_weight_stream)


def _alive(fanout: FanOut) -> bool:
    """Whether the handle's ranks still run (not shut down, no rank failure ended them)."""
    return fanout.is_alive
