"""Hub-layout weights off the ranks a bucket at a time (issue 31): to the driver, or straight to a rollout engine.

Every rank walks the whole model's parameters in one order (the names of the model ``runner.gathered`` returns),
gathering each one it holds a shard of (``full_tensor``: a collective of the ranks holding it) and, under pipeline
parallelism, sending rank 0 what rank 0's stage lacks (the rank at rank 0's place in the stage that holds it, over
the pp group, as ``PipelineStages.gathered`` does). Rank 0 turns the full tensors into exactly the hub tensors
``save_pretrained`` writes (:func:`raymoe.rank.save.as_saved`: MXFP4 experts dequantized, LoRA merged; then
:func:`~raymoe.checkpoint.model_io.hub_tensors`: cast, fused experts split) and fills buckets of CPU copies.

Only rank 0 sees where a bucket ends (its bytes), so before each parameter it broadcasts "go" (one element over
the world group) and it ends every call with "pause", or "end" once it has no bucket left (it may still hold some
when the walk is over: the last parameter's hub tensors); the other ranks follow::

    call k    rank 0    go, gather p5   go, gather p6 (bucket full)   pause   -> [(hub name, CPU tensor), ...]
              rank 1..  go? gather p5   go? gather p6                 pause?  -> None
    call k+1            go, gather p7 ...                             ...
    last call rank 0    (no bucket left)                              end     -> None; every rank drops the stream

``push_hub_weights`` is one call: the walk runs to the end, rank 0 sending each bucket to the receivers as it
is full (``receiver.<method>.remote(bucket)``), and says "end" when the last one is applied or a receiver failed.

Between calls no collective is pending: a rank runs other calls (a forward) while the driver holds a bucket. Each
bucket holds the weights as they were when it was gathered (a train step between buckets streams a mix).

Memory: rank 0 holds one bucket of CPU copies, the parameter being split, and what unpacking or merging waits for
(a packed weight's blocks until its scales, an adapted base until its factors); the other ranks one full parameter.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from raymoe.checkpoint.model_io import hub_tensors
from raymoe.rank.context import LoadedModel, RankContext
from raymoe.rank.contract import PushAnswer
from raymoe.rank.save import as_saved
from raymoe.spec.topology import Axis

Bucket = list[tuple[str, Tensor]]  # (hub name, full CPU tensor), in the order save_pretrained writes them


def start_weight_stream(ctx: RankContext, bucket_bytes: int, dtype: torch.dtype | None) -> None:
    """Every rank: open a stream of buckets of about ``bucket_bytes`` (``dtype``: None, the checkpoint's dtype),
    replacing any stream left open."""
    loaded = ctx.require_model()
    loaded.weight_stream = None
    loaded.weight_stream = WeightStream(ctx, loaded, bucket_bytes, dtype)


def next_weight_bucket(ctx: RankContext) -> Bucket | None:
    """Every rank: gather the next bucket; rank 0 answers it, or None once the stream is done (then it is dropped);
    the other ranks answer None."""
    loaded = ctx.require_model()
    stream = loaded.weight_stream
    if stream is None:
        raise RuntimeError("next_weight_bucket before start_weight_stream: no weight stream is open on this rank")
    bucket, done = stream.next_bucket(ctx)
    if done:
        loaded.weight_stream = None
    return bucket


def end_weight_stream(ctx: RankContext) -> None:
    """Every rank: drop the open stream (a driver's iterator closed early); no collective."""
    if ctx.loaded is not None:
        ctx.loaded.weight_stream = None


def push_hub_weights(
    ctx: RankContext, receivers: Sequence[Any], method: str, bucket_bytes: int, dtype: torch.dtype | None
) -> PushAnswer | None:
    """Every rank: stream every bucket; rank 0 calls ``getattr(receiver, method).remote(bucket)`` on each receiver
    (Ray actor handles) and answers a :class:`~raymoe.rank.contract.PushAnswer` once every receiver has applied the
    last bucket; the other ranks answer None.

    One bucket is in flight while rank 0 gathers the next; before sending it, rank 0 waits for every receiver to
    have applied the one before. A receiver's exception ends the walk (the other ranks follow the "end") and comes
    back as ``error`` naming the receiver, so the model stays loaded.
    """
    loaded = ctx.require_model()
    stream = WeightStream(ctx, loaded, bucket_bytes, dtype)
    if stream.buckets is None:
        stream.walk.follow(ctx)
        return None
    report: dict[str, Any] = {"buckets": 0, "tensors": 0, "bytes": 0, "error": None}
    in_flight: list[Any] = []
    try:
        for bucket in stream.buckets:
            report["error"] = applied(in_flight, method, report["buckets"] - 1)
            if report["error"] is not None:
                break
            in_flight = [getattr(receiver, method).remote(bucket) for receiver in receivers]
            report["buckets"] += 1
            report["tensors"] += len(bucket)
            report["bytes"] += sum(tensor.numel() * tensor.element_size() for _, tensor in bucket)
            del bucket  # each receiver's copy is in the object store: the next bucket is filled without this one
        else:
            report["error"] = applied(in_flight, method, report["buckets"] - 1)
    finally:
        _signal(ctx, _END)
    return PushAnswer(report["buckets"], report["tensors"], report["bytes"], report["error"])


def applied(refs: Sequence[Any], method: str, bucket: int) -> str | None:
    """Wait for every receiver's ``method`` call on ``bucket`` (``refs[i]``: receiver i's ObjectRef); the first
    failure as a sentence, None when all applied it."""
    failure = None
    for index, ref in enumerate(refs):
        try:
            ref.future().result()
        except Exception as error:  # a RayTaskError (the receiver raised) or RayActorError (it died)
            cause = getattr(error, "cause", None) or error
            if failure is None:
                failure = f"receiver {index}: {method}(bucket {bucket}) raised {type(cause).__name__}: {cause}"
    return failure


class WeightStream:
    """One rank's part in a stream: its :class:`ParameterWalk`, and on rank 0 the buckets it fills."""

    def __init__(self, ctx: RankContext, loaded: LoadedModel, bucket_bytes: int, dtype: torch.dtype | None) -> None:
        self.walk = ParameterWalk(ctx, loaded)
        self.buckets: Iterator[Bucket] | None = None
        if ctx.rank == 0:
            saved = as_saved(loaded, self.walk.full_tensors(ctx))
            self.buckets = buckets_of(
                hub_tensors(self.walk.whole, saved, loaded.precision.checkpoint if dtype is None else dtype),
                bucket_bytes,
            )

    def next_bucket(self, ctx: RankContext) -> tuple[Bucket | None, bool]:
        """The next bucket (rank 0; None elsewhere) and whether the stream is done (rank 0 says so to every rank:
        it may still hold buckets once the walk is over, the last parameter's hub tensors)."""
        if self.buckets is None:
            return None, self.walk.follow(ctx) == _END
        bucket = None
        try:
            bucket = next(self.buckets, None)
        finally:
            _signal(ctx, _PAUSE if bucket is not None else _END)
        return bucket, bucket is None


class ParameterWalk:
    """Every parameter of the whole model in full on rank 0, one at a time in ``names`` order, every rank taking part.

    ``sources`` (on the ranks of rank 0's pp group): the parameters rank 0's stage lacks -> ``(pp rank of the
    stage that holds it, shape, dtype)``; learnt once, from every stage's held parameters (one object all-gather
    over each pp group). Without pipeline parallelism rank 0 holds every parameter and ``sources`` is empty.
    """

    def __init__(self, ctx: RankContext, loaded: LoadedModel) -> None:
        self.whole, _ = loaded.runner.gathered(ctx, loaded.spec)  # names only: its iterator is never started
        self.names = [name for name, _ in self.whole.named_parameters()]
        self.mine = dict(loaded.named_parameters())
        self.position = 0
        self.group = ctx.mesh(Axis.PP).get_group()
        held = {name: (tuple(param.shape), param.dtype) for name, param in self.mine.items()}
        stages: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(stages, held, group=self.group)
        self.sources: dict[str, tuple[int, tuple[int, ...], torch.dtype]] = {}
        if 0 in ctx.topology.group_of(ctx.rank, Axis.PP):
            for name in self.names:
                if name not in stages[0]:
                    src = next((pp for pp, found in enumerate(stages) if name in found), None)
                    if src is None:
                        raise RuntimeError(f"streaming weights: no pipeline stage holds parameter {name!r}")
                    shape, dtype = stages[src][name]
                    self.sources[name] = (src, shape, dtype)

    def full_tensors(self, ctx: RankContext) -> Iterator[tuple[str, Tensor]]:
        """Rank 0: ``(name, full tensor on the device)``, each after telling the other ranks to go on."""
        while self.position < len(self.names):
            _signal(ctx, _GO)
            name, full = self.step(ctx)
            assert full is not None
            yield name, full

    def follow(self, ctx: RankContext) -> int:
        """The other ranks: take part in each parameter rank 0 goes on to, until it pauses or ends the stream (which
        it answers)."""
        while (signal := _signal(ctx)) == _GO:
            self.step(ctx)
        return signal

    def step(self, ctx: RankContext) -> tuple[str, Tensor | None]:
        """This rank's part in gathering the next parameter: the name, and the full tensor on rank 0."""
        name = self.names[self.position]
        self.position += 1
        param = self.mine.get(name)
        full: Tensor | None = None
        if param is not None:
            full = param.full_tensor() if isinstance(param, DTensor) else param.detach()
        if name in self.sources:
            src, shape, dtype = self.sources[name]
            if ctx.rank == 0:
                full = torch.empty(shape, dtype=dtype, device=ctx.device)
                dist.recv(full, group=self.group, group_src=src)
            elif ctx.coords.pp == src:
                assert full is not None
                dist.send(full.contiguous(), group=self.group, group_dst=0)
        return name, full if ctx.rank == 0 else None


def buckets_of(tensors: Iterator[tuple[str, Tensor]], bucket_bytes: int) -> Iterator[Bucket]:
    """``(hub name, tensor)`` in buckets of CPU copies (each its own storage): a bucket is closed once its bytes
    reach ``bucket_bytes`` or the next tensor would take it past them; a tensor larger than that is a bucket alone."""
    bucket: Bucket = []
    size = 0
    for key, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((key, tensor.detach().to("cpu", copy=True).contiguous()))
        size += nbytes
        if size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket


_PAUSE, _GO, _END = 0, 1, 2  # rank 0's signals: the call is over / one more parameter / the stream is over


def _signal(ctx: RankContext, signal: int = _PAUSE) -> int:
    """Rank 0's ``signal``, broadcast to every rank over the world group (the other ranks' argument is unused)."""
    flag = torch.tensor([signal], dtype=torch.int32, device=ctx.device)
    dist.broadcast(flag, src=0)
    return int(flag.item())
