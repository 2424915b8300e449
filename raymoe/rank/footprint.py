"""What a rank holds of a model, in bytes: planned on meta before any cluster starts, or measured on a loaded rank.

    planned_memory(spec, rank, checkpoint_dtype)       in this process, no cluster, no weights:
        a fake world of ``topology.world_size`` ranks in which this process is ``rank`` (torch's "fake" backend:
        process groups whose collectives do nothing) -> the spec's meta model, held in the precision policy's dtypes
        and sharded exactly as :func:`raymoe.rank.load.load_shards` shards it (TP -> EP -> packed experts ->
        activation checkpointing -> FSDP2, the same functions) -> the local shard of every placeholder, counted
    held_memory(ctx)                                   a rank function, on a loaded rank: the same count of its
                                                       real shards, gradients and AdamW states

Both return a :class:`~raymoe.rank.contract.RankMemory`. The planned gradients and optimizer states follow from the
trainable shards by torch's rules, which the measured ones check (``tests/rank/test_footprint.py``): a gradient is
shaped and typed like its parameter's local shard (FSDP2 and DTensor keep gradients sharded as the parameter is);
fused AdamW keeps ``exp_avg`` and ``exp_avg_sq`` like the shard and a 0-d float32 ``step`` per parameter. Frozen
parameters (a LoRA base, MXFP4 experts kept packed) have neither.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import Tensor, nn

from raymoe.parallel.sharding import local_tensor
from raymoe.rank.context import RankContext
from raymoe.rank.contract import RankMemory
from raymoe.rank.load import sharded_on_meta
from raymoe.spec.launch import LaunchSpec
from raymoe.spec.precision import resolve_policy

ADAMW_MOMENTS = 2  # exp_avg, exp_avg_sq: each shaped and typed like the parameter's shard
ADAMW_STEP_BYTES = 4  # fused AdamW's per-parameter step: a 0-d float32 tensor


@contextmanager
def fake_world(rank: int, world_size: int) -> Iterator[RankContext]:
    """This process as ``rank`` of a world of ``world_size`` whose collectives do nothing (torch's "fake" backend),
    for building meshes and sharding on meta; the world is left on exit. A process that already has a
    ``torch.distributed`` world cannot host one (it has one default group)."""
    if dist.is_initialized():
        raise RuntimeError(
            "planning needs a process without a torch.distributed world (it builds fake worlds of the layout's size); "
            "this one has one (a LocalRankGroup, or init_process_group): plan before it, or run `raymoe plan`"
        )
    dist.init_process_group("fake", rank=rank, world_size=world_size)
    try:
        yield RankContext(rank, world_size, torch.device("cpu"), "fake")
    finally:
        dist.destroy_process_group()


def planned_memory(spec: LaunchSpec, rank: int, checkpoint_dtype: torch.dtype) -> RankMemory:
    """What ``rank`` of ``spec``'s layout will hold once loaded and trained one step, counted on meta in a fake
    world. ``checkpoint_dtype``: the dtype the checkpoint stores its weights in (the policy's ``auto`` reads it)."""
    policy = resolve_policy(spec.precision, spec.torch_dtype, checkpoint_dtype)
    with fake_world(rank, spec.topology.world_size) as ctx:
        ctx.use_layout(spec.topology)
        runner = sharded_on_meta(spec, ctx, policy, spec.build_meta_model())
        params = _unique(p for part in runner.parts for p in part.parameters())
    trainable = [local_tensor(p) for p in params if p.requires_grad]
    trainable_bytes = _bytes(trainable)
    return RankMemory(
        rank,
        parameters=_bytes(local_tensor(p) for p in params),
        gradients=trainable_bytes,
        optimizer=ADAMW_MOMENTS * trainable_bytes + ADAMW_STEP_BYTES * len(trainable),
        parameter_elements=sum(local_tensor(p).numel() for p in params),
        trainable_elements=sum(t.numel() for t in trainable),
    )


def held_memory(ctx: RankContext) -> RankMemory:
    """Rank function: what this rank holds now, counted from its real shards: parameters, the gradients present
    (between a backward and the optimizer step; none otherwise: each step clears them), AdamW's states (after the
    first step; fused AdamW makes them then)."""
    loaded = ctx.require_model()
    params = _unique(p for part in loaded.parts for p in part.parameters())
    grads = [local_tensor(p.grad) for p in params if p.grad is not None]
    states: list[Tensor] = []
    if loaded.training is not None:
        for state in loaded.training.optimizer.state.values():
            states.extend(local_tensor(value) for value in state.values() if isinstance(value, Tensor))
    return RankMemory(
        ctx.rank,
        parameters=_bytes(local_tensor(p) for p in params),
        gradients=_bytes(grads),
        optimizer=_bytes(states),
        parameter_elements=sum(local_tensor(p).numel() for p in params),
        trainable_elements=sum(local_tensor(p).numel() for p in params if p.requires_grad),
    )


def _unique(params: Iterable[nn.Parameter]) -> list[nn.Parameter]:
    """Each parameter once (a tied head and embedding are one; pipeline parts hold disjoint ones)."""
    return list({id(p): p for p in params}.values())


def _bytes(tensors: Iterable[Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)
