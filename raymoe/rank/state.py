"""Training state on the ranks: every rank writes and reads its own shards with torch DCP (no gather).

Format and driver-side checks: :mod:`raymoe.checkpoint.training_state`. A save goes into a staging
directory the driver named beside the target; rank 0 adds the manifest and swaps the directory in
only after DCP finished on every rank (its ``.metadata`` is written once all ranks' data is)::

    every rank   dcp.save(own shards -> staging/)           (async: staged to CPU memory, written by a thread)
    rank 0       staging/raymoe_state.json, staging -> target  (async: when its write finishes)

A failed write on any rank fails DCP's collective on every rank, so all of them answer the failure and
nothing is swapped in; the model and its optimizer are untouched. A load reads into fresh tensors laid
out like this rank's shards (DCP reshards from whatever layout saved them) and copies them in only
after DCP succeeded on every rank, so a failed load changes nothing.

DCP's collectives run on a gloo group of their own (:meth:`RankContext.checkpoint_group`), so an
asynchronous save's thread never shares a group with the training step's collectives.
"""

from __future__ import annotations

import io
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
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from raymoe.checkpoint.staging import CheckpointSaveError, swap_in, write_json
from raymoe.checkpoint.training_state import MANIFEST_FILE, MOMENTS, model_entries, model_key, optimizer_key, rng_key
from raymoe.models.common.decoder import CausalLM
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
    writer = FileSystemWriter(request.staging, single_file_per_rank=True, sync_files=True)
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
    staging = Path(request.staging)
    if rank != 0:
        return StateAnswer(seconds=time.perf_counter() - start, bytes_written=written)
    try:
        write_json(staging / MANIFEST_FILE, request.manifest)
        swap_in(staging, Path(request.target), replaced=("*",))
    except CheckpointSaveError as error:
        shutil.rmtree(staging, ignore_errors=True)
        return StateAnswer(error=str(error), errno=error.errno, seconds=time.perf_counter() - start)
    return StateAnswer(seconds=time.perf_counter() - start, bytes_written=written)


def _failed(rank: int, request: StateRequest, error: BaseException, start: float) -> StateAnswer:
    """Every rank answers DCP's failure; rank 0 removes the staging directory (the target was never touched)."""
    if rank == 0:
        shutil.rmtree(request.staging, ignore_errors=True)
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
    """Read the state in ``directory`` into this rank's layout; on success make it the model's weights, a new AdamW
    (``optimizer``, ``balance``) with the saved moments, and this rank's RNG (when the state has rank
    ``ctx.rank``'s). On failure answer it and change nothing."""
    loaded = ctx.require_model()
    for part in loaded.parts:
        _reshard(part)
    start = time.perf_counter()
    reader = FileSystemReader(directory)
    fresh = _empty_state(loaded)
    has_rng = rng_key(ctx.rank) in reader.read_metadata().state_dict_metadata
    if has_rng:
        fresh[rng_key(ctx.rank)] = b""
    try:
        dcp.load(fresh, storage_reader=reader, planner=BoxLoadPlanner(), process_group=ctx.checkpoint_group())
    except (CheckpointException, Exception) as error:
        cause, errno = describe_failure(error)
        return StateAnswer(error=cause, errno=errno, seconds=time.perf_counter() - start)
    configure_optimizer(ctx, optimizer, balance)
    _assign(loaded, fresh)
    if has_rng:
        _set_rng(fresh[rng_key(ctx.rank)], ctx.device)
    return StateAnswer(seconds=time.perf_counter() - start)


def _entries(loaded: LoadedModel) -> dict[str, Tensor]:
    """The model's tensors this rank holds (of every pipeline stage it runs), by name in the whole model."""
    return {name: value for part in loaded.parts for name, value in model_entries(part).items()}


def _empty_state(loaded: LoadedModel) -> dict[str, Any]:
    """Uninitialised tensors laid out like this rank's parameters, buffers and moments: what DCP reads into."""
    entries = _entries(loaded).items()
    state: dict[str, Any] = {model_key(name): torch.empty_like(value.detach()) for name, value in entries}
    for name, param in loaded.named_parameters():
        if param.requires_grad:
            for moment in MOMENTS:
                state[optimizer_key(name, moment)] = torch.empty_like(param.detach())
            state[optimizer_key(name, "step")] = torch.zeros((), dtype=torch.float32)
    return state


def _assign(loaded: LoadedModel, fresh: dict[str, Any]) -> None:
    """Copy the read tensors into the model's own storage; the moments become the new AdamW's state."""
    optimizer = loaded.require_training().optimizer
    with torch.no_grad():
        for name, value in _entries(loaded).items():
            _local(value).copy_(_local(fresh[model_key(name)]))
    for name, param in loaded.named_parameters():
        if param.requires_grad:
            optimizer.state[param] = {
                "step": fresh[optimizer_key(name, "step")].to(_local(param).device),  # fused AdamW: on the device
                **{moment: fresh[optimizer_key(name, moment)] for moment in MOMENTS},
            }


def _local(tensor: Tensor) -> Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


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
