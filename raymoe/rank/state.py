"""Training state on the ranks: every rank writes and reads its own shards with torch DCP (no gather).

Format and driver-side checks: :mod:`raymoe.checkpoint.training_state`. A save goes into a staging
directory the driver named beside the target; rank 0 adds the manifest and swaps the directory in
only after DCP finished on every rank (its ``.metadata`` is written once all ranks' data is)::

    every rank   dcp.save(own shards -> staging/)           (async: staged to CPU memory, written by a thread)
    rank 0       staging/raymoe_state.json, staging -> target  (async: when its write finishes)

A failed write on any rank fails DCP's collective on every rank, so all of them answer the failure and
nothing is swapped in; the model and its optimizer are untouched. A load reads in place, into this rank's
own parameter shards and AdamW moments (DCP reshards from whatever layout saved them, one saved chunk at a
time through host memory), so it needs no second copy of the state. The driver checks everything knowable
before any rank reads (:func:`~raymoe.checkpoint.training_state.check_training_state`); a load that still
fails before DCP's first copy changes nothing, one that fails after it ends the rank group
(:class:`PartialLoadError`).

On a storage URL (``s3://...``) the staging directory is a new generation under the target, written through DCP's
fsspec writer, and rank 0 commits it by writing the target's commit marker (:mod:`raymoe.checkpoint.committed`):
object stores have no rename. A load reads the generation the driver resolved, through DCP's fsspec reader.

DCP's collectives run on a gloo group of their own (:meth:`RankContext.checkpoint_group`), so an
asynchronous save's thread never shares a group with the training step's collectives.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import shutil
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.distributed.fsdp import FSDPModule

from raymoe.checkpoint.committed import commit
from raymoe.checkpoint.staging import CheckpointSaveError, swap_in, write_json
from raymoe.checkpoint.storage import StorageUrl, location_of, write_bytes
from raymoe.checkpoint.training_state import MANIFEST_FILE, MOMENTS, model_entries, model_key, optimizer_key, rng_key
from raymoe.models.common.decoder import CausalLM
from raymoe.parallel.sharding import local_tensor
from raymoe.parallel.state_planner import BoxLoadPlanner, BoxSavePlanner
from raymoe.rank.context import LoadedModel, RankContext
from raymoe.rank.contract import StateAnswer, StateRequest
from raymoe.rank.train import configure_optimizer
from raymoe.spec.balance import BalanceConfig
from raymoe.spec.optimizer import OptimizerConfig


@dataclass
class PendingSave:
    """An asynchronous save in flight on this rank; rank 0 commits it (manifest, swap) when DCP's future is done."""

    request: StateRequest
    future: Future[Any]  # DCP's: the writing thread's result
    committed: Future[StateAnswer] = field(default_factory=Future)


# --- save ----------------------------------------------------------------------------------------


def save_training_state(ctx: RankContext, request: StateRequest) -> StateAnswer:
    """Write this rank's shards of the model, AdamW state and RNG into ``request.staging``; rank 0 commits."""
    loaded = ctx.require_model()
    if loaded.pending_save is not None:
        raise RuntimeError("a save is still in flight on this rank; the driver waits for it before the next one")
    state = training_state_dict(ctx, loaded)
    writer = _writer(request.staging)
    start = time.perf_counter()
    if request.async_save:
        future = dcp.async_save(
            state, storage_writer=writer, planner=BoxSavePlanner(), process_group=ctx.checkpoint_group()
        )
        assert isinstance(future, Future)  # the thread checkpointer's answer
        pending = PendingSave(request, future)
        future.add_done_callback(lambda done: _settle(pending, ctx.rank, done, start))
        loaded.pending_save = pending
        return StateAnswer(seconds=time.perf_counter() - start)
    try:
        metadata = dcp.save(
            state, storage_writer=writer, planner=BoxSavePlanner(), process_group=ctx.checkpoint_group()
        )
    except (CheckpointException, Exception) as error:
        return _failed(ctx.rank, request, error, start)
    return _commit(ctx.rank, request, start, _bytes_written(metadata, ctx.rank))


def _writer(staging: str) -> FileSystemWriter:
    """DCP's writer of ``staging``: the local one, or fsspec's for a storage URL (no rename on object stores: DCP's
    ``.metadata`` is written in place, and the commit marker, not a rename, makes the state visible)."""
    if isinstance(location_of(staging), StorageUrl):
        return FsspecWriter(staging, single_file_per_rank=True, sync_files=False, overwrite=True)
    return FileSystemWriter(staging, single_file_per_rank=True, sync_files=True)


def wait_for_state_save(ctx: RankContext) -> StateAnswer | None:
    """Wait for this rank's asynchronous save (and rank 0's commit); None when there was none."""
    loaded = ctx.require_model()
    pending = loaded.pending_save
    if pending is None:
        return None
    try:
        return pending.committed.result()
    finally:
        loaded.pending_save = None


def _settle(pending: PendingSave, rank: int, done: Future[Any], start: float) -> None:
    """DCP's future is done: commit (rank 0) and settle ``pending.committed`` whatever happens (no wait hangs)."""
    try:
        answer = _finish(rank, pending.request, done, start)
    except BaseException as error:  # a bug or an interpreter shutting down: still an answer for the driver
        answer = StateAnswer(
            error=f"{type(error).__name__}: {error} while finishing the save into {pending.request.staging}"
        )
    pending.committed.set_result(answer)


def _finish(rank: int, request: StateRequest, done: Future[Any], start: float) -> StateAnswer:
    error = done.exception()
    if error is not None:
        return _failed(rank, request, error, start)
    return _commit(rank, request, start, _bytes_written(done.result(), rank))


def _commit(rank: int, request: StateRequest, start: float, written: int) -> StateAnswer:
    """Rank 0: the manifest, then the staging directory swapped in whole (other ranks may still be returning from
    DCP: nothing here reads the staging directory but rank 0). Every rank reports the bytes it wrote."""
    if rank != 0:
        return StateAnswer(seconds=time.perf_counter() - start, bytes_written=written)
    staging, target = location_of(request.staging), location_of(request.target)
    try:
        if isinstance(staging, StorageUrl) and isinstance(target, StorageUrl):
            write_bytes(staging.join(MANIFEST_FILE), json.dumps(request.manifest, indent=2).encode())
            commit(target, staging)
        elif isinstance(staging, Path) and isinstance(target, Path):
            write_json(staging / MANIFEST_FILE, request.manifest)
            swap_in(staging, target, replaced=("*",))
        else:
            raise CheckpointSaveError(f"a state staged in {staging} cannot be committed to {target}")
    except Exception as error:  # a failed swap, or what a storage URL's filesystem raised
        _remove_staging(request.staging)
        return StateAnswer(
            error=str(error) if isinstance(error, CheckpointSaveError) else f"{error!r} while committing {staging}",
            errno=getattr(error, "errno", None),
            seconds=time.perf_counter() - start,
        )
    return StateAnswer(seconds=time.perf_counter() - start, bytes_written=written)


def _remove_staging(staging: str) -> None:
    """Remove what a save that failed wrote (best effort: a URL's next save removes what is left)."""
    where = location_of(staging)
    if isinstance(where, StorageUrl):
        with contextlib.suppress(Exception):  # best effort: the next save removes what is left
            where.filesystem().rm(where.path, recursive=True)
    else:
        shutil.rmtree(where, ignore_errors=True)


def _failed(rank: int, request: StateRequest, error: BaseException, start: float) -> StateAnswer:
    """Every rank answers DCP's failure; rank 0 removes the staging directory (the target was never touched)."""
    if rank == 0:
        _remove_staging(request.staging)
    cause, errno = describe_failure(error)
    return StateAnswer(
        error=f"{cause} while writing into {request.staging}", errno=errno, seconds=time.perf_counter() - start
    )


def describe_failure(error: BaseException) -> tuple[str, int | None]:
    """One line per failing rank (``rank 1: OSError: [Errno 28] ...: '<file>'``) and the first ``errno``."""
    failures = error.failures if isinstance(error, CheckpointException) else {-1: (error, None)}
    lines, errno = [], None
    for rank, (cause, _) in sorted(failures.items()):
        where = f"rank {rank}: " if rank >= 0 else ""
        lines.append(f"{where}{type(cause).__name__}: {cause}")
        if errno is None and isinstance(cause, OSError):
            errno = cause.errno
    return "; ".join(lines), errno


def _bytes_written(metadata: Metadata, rank: int) -> int:
    """The bytes DCP's metadata records in this rank's data files (``__<rank>_<n>.distcp``)."""
    infos = (metadata.storage_data or {}).values()
    return sum(int(info.length) for info in infos if info.relative_path.startswith(f"__{rank}_"))


def training_state_dict(ctx: RankContext, loaded: LoadedModel) -> dict[str, Any]:
    """This rank's entries of the state (format: :mod:`raymoe.checkpoint.training_state`), sharing storage with
    the model and optimizer; moments a parameter does not have yet (no step taken) are zeros, as AdamW starts."""
    for part in loaded.parts:
        _reshard(part)
    optimizer = loaded.require_training().optimizer
    state: dict[str, Any] = {model_key(name): value.detach() for name, value in _entries(loaded).items()}
    for name, param in loaded.named_parameters():
        if not param.requires_grad:
            continue
        moments = optimizer.state.get(param) or {}
        for moment in MOMENTS:
            state[optimizer_key(name, moment)] = moments.get(moment, None)
            if state[optimizer_key(name, moment)] is None:
                state[optimizer_key(name, moment)] = torch.zeros_like(param.detach())
        state[optimizer_key(name, "step")] = moments.get("step", torch.zeros((), dtype=torch.float32))
    state[rng_key(ctx.rank)] = _rng_bytes(ctx.device)
    return state


# --- load ----------------------------------------------------------------------------------------


def load_training_state(
    ctx: RankContext, directory: str, optimizer: OptimizerConfig, balance: BalanceConfig
) -> StateAnswer:
    """Read the state in ``directory`` into this rank's own tensors (no second copy); on success they are the model's
    weights and, under a new AdamW (``optimizer``, ``balance``), its moments, and this rank's RNG is restored (when
    the state has rank ``ctx.rank``'s).

    DCP reads one saved chunk at a time into host memory and copies it into its place (the parameters' shards, the
    moments; moments a parameter has no state for yet are made once, where they stay). A failure before the first
    copy (DCP's plan, a first unreadable chunk) is answered and changes nothing; one after it raises
    :class:`PartialLoadError`, which ends the rank group (the weights are partly the state's).
    """
    loaded = ctx.require_model()
    for part in loaded.parts:
        _reshard(part)
    start = time.perf_counter()
    reader = _chunk_by_chunk_reader(directory)
    targets = _load_targets(loaded)
    has_rng = rng_key(ctx.rank) in reader.read_metadata().state_dict_metadata
    if has_rng:
        targets[rng_key(ctx.rank)] = b""
    planner = _InPlaceLoadPlanner()
    try:
        dcp.load(targets, storage_reader=reader, planner=planner, process_group=ctx.checkpoint_group())
    except (CheckpointException, Exception) as error:
        cause, errno = describe_failure(error)
        if planner.copied:
            raise PartialLoadError(
                f"load_state({directory!r}) failed after reading part of it into this model's weights and "
                f"optimizer state in place: {cause}; they are neither the model's nor the state's: load the model "
                "again and call load_state once the cause is fixed"
            ) from error
        return StateAnswer(error=cause, errno=errno, seconds=time.perf_counter() - start)
    configure_optimizer(ctx, optimizer, balance)
    _adopt_moments(loaded, targets)
    if has_rng:
        _set_rng(targets[rng_key(ctx.rank)], ctx.device)
    return StateAnswer(seconds=time.perf_counter() - start)


class PartialLoadError(RuntimeError):
    """A load that failed after DCP had copied part of the state into the model's own tensors (they are now
    neither the model's nor the state's): raised on the rank, it ends the rank group."""


class _InPlaceLoadPlanner(BoxLoadPlanner):
    """:class:`BoxLoadPlanner` that records whether DCP has started copying into the state dict's tensors (it asks
    for a target just before each copy), so a failure can say whether the model was touched."""

    copied = False

    def resolve_tensor(self, read_item: ReadItem) -> Tensor:
        self.copied = True
        target: Tensor = super().resolve_tensor(read_item)
        return target


class _ChunkByChunkReader(FileSystemReader):
    """:class:`FileSystemReader` that holds one saved chunk in host memory at a time: DCP's reader keeps the chunk
    it last copied until the next one is read, so two of the largest would be staged at once. Each read item is
    read by a call of its own (its file opened again), so the chunk is released when that call returns."""

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future[None]:
        for item in plan.items:
            super().read_data(dataclasses.replace(plan, items=[item]), planner).wait()
        done: torch.futures.Future[None] = torch.futures.Future()
        done.set_result(None)
        return done


class _ChunkByChunkFsspecReader(FsspecReader, _ChunkByChunkReader):
    """:class:`_ChunkByChunkReader` of a storage URL (DCP's fsspec reader: its filesystem, the same reads)."""


def _chunk_by_chunk_reader(directory: str) -> FileSystemReader:
    if isinstance(location_of(directory), StorageUrl):
        return _ChunkByChunkFsspecReader(directory)
    return _ChunkByChunkReader(directory)


def _entries(loaded: LoadedModel) -> dict[str, Tensor]:
    """The model's tensors this rank holds (of every pipeline stage it runs), by name in the whole model."""
    return {name: value for part in loaded.parts for name, value in model_entries(part).items()}


def _load_targets(loaded: LoadedModel) -> dict[str, Any]:
    """What DCP reads into, sharing storage with the model: its parameters and buffers (this rank's shards), and
    per trainable parameter the current AdamW's moments (shaped like the parameter's shard) and step (0-d float32,
    on the parameter's device, as fused AdamW keeps it); made here, uninitialised, where the optimizer has none
    (no step taken, or no optimizer yet): they become the new AdamW's state where they are."""
    state: dict[str, Any] = {model_key(name): value.detach() for name, value in _entries(loaded).items()}
    held = loaded.training.optimizer.state if loaded.training is not None else {}
    for name, param in loaded.named_parameters():
        if not param.requires_grad:
            continue
        moments = held.get(param) or {}
        for moment in MOMENTS:
            state[optimizer_key(name, moment)] = moments.get(moment)
            if state[optimizer_key(name, moment)] is None:
                state[optimizer_key(name, moment)] = torch.empty_like(param.detach())
        state[optimizer_key(name, "step")] = moments.get("step")
        if state[optimizer_key(name, "step")] is None:
            state[optimizer_key(name, "step")] = torch.zeros((), dtype=torch.float32, device=local_tensor(param).device)
    return state


def _adopt_moments(loaded: LoadedModel, targets: dict[str, Any]) -> None:
    """The tensors DCP read the moments and steps into become the new AdamW's state (no copy)."""
    optimizer = loaded.require_training().optimizer
    for name, param in loaded.named_parameters():
        if param.requires_grad:
            optimizer.state[param] = {what: targets[optimizer_key(name, what)] for what in ("step", *MOMENTS)}


def _reshard(model: CausalLM) -> None:
    """FSDP2 keeps the root's parameters gathered after a forward without backward (inference); put every module
    back on its shards so the state names the sharded parameters the optimizer steps."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _rng_bytes(device: torch.device) -> bytes:
    states = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    buffer = io.BytesIO()
    torch.save(states, buffer)
    return buffer.getvalue()


def _set_rng(saved: bytes, device: torch.device) -> None:
    states = torch.load(io.BytesIO(saved), weights_only=True)
    torch.set_rng_state(states["cpu"])
    if device.type == "cuda" and "cuda" in states:
        torch.cuda.set_rng_state(states["cuda"], device)
