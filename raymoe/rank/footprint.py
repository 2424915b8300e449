"""What a rank holds of a model, in bytes: planned on meta before any cluster starts, or measured on a loaded rank.

    planned_memory(ctx, spec, checkpoint_dtype)        a rank function, on a simulated rank (raymoe.rank.fake: no
        cluster, no weights; a PlannedRank) -> the spec's meta model, held in the precision policy's dtypes
        and sharded exactly as :func:`raymoe.rank.load.load_shards` shards it (TP -> EP -> packed experts ->
        activation checkpointing -> FSDP2, the same functions) -> the local shard of every placeholder, counted;
        and what FSDP2 gathers of the largest decoder layer and of every unit (for the step's estimate)
    held_memory(ctx)                                   a rank function, on a loaded rank: the same count of its
                                                       real shards, gradients and AdamW states

Both return a :class:`~raymoe.rank.contract.RankMemory`. The planned gradients and optimizer states follow from the
trainable shards by torch's rules, which the measured ones check (``tests/rank/test_footprint.py``): a gradient is
shaped and typed like its parameter's local shard (FSDP2 and DTensor keep gradients sharded as the parameter is);
fused AdamW keeps ``exp_avg`` and ``exp_avg_sq`` like the shard and a 0-d float32 ``step`` per parameter. Frozen
parameters (a LoRA base, MXFP4 experts kept packed) have neither.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from raymoe.parallel.fsdp import gathered_bytes
from raymoe.parallel.sharding import local_tensor
from raymoe.rank.context import RankContext
from raymoe.rank.contract import PlannedRank, RankMemory
from raymoe.rank.load import sharded_on_meta
from raymoe.spec.launch import LaunchSpec
from raymoe.spec.precision import PrecisionPolicy, resolve_policy
from raymoe.spec.topology import FSDP_CP, Axis

ADAMW_MOMENTS = 2  # exp_avg, exp_avg_sq: each shaped and typed like the parameter's shard
ADAMW_STEP_BYTES = 4  # fused AdamW's per-parameter step: a 0-d float32 tensor


def planned_memory(ctx: RankContext, spec: LaunchSpec, checkpoint_dtype: torch.dtype) -> PlannedRank:
    """Rank function, on a simulated rank (:class:`raymoe.rank.fake.FakeWorlds`): what this rank of ``spec``'s layout
    will hold once loaded and trained one step, counted on meta. ``checkpoint_dtype``: the dtype the checkpoint
    stores its weights in (the precision policy's ``auto`` reads it)."""
    policy = resolve_policy(spec.precision, spec.torch_dtype, checkpoint_dtype)
    ctx.use_layout(spec.topology)
    runner = sharded_on_meta(spec, ctx, policy, spec.build_meta_model())
    named = {id(p): (name, p) for part in runner.parts for name, p in part.named_parameters()}
    wrapped = any(isinstance(m, FSDPModule) for part in runner.parts for m in part.modules())
    params = [p for _, p in named.values()]
    trainable = [local_tensor(p) for p in params if p.requires_grad]
    trainable_bytes = _bytes(trainable)
    memory = RankMemory(
        ctx.rank,
        parameters=_bytes(local_tensor(p) for p in params),
        gradients=trainable_bytes,
        optimizer=ADAMW_MOMENTS * trainable_bytes + ADAMW_STEP_BYTES * len(trainable),
        trainable=trainable_bytes,
        parameter_elements=sum(local_tensor(p).numel() for p in params),
        trainable_elements=sum(t.numel() for t in trainable),
    )
    if not wrapped:
        return PlannedRank(memory)
    gathered = sum(gathered_bytes(part) for part in runner.parts)
    return PlannedRank(memory, *_largest_layer_gather(list(named.values()), policy), gathered=gathered)


def _largest_layer_gather(named: list[tuple[str, nn.Parameter]], policy: PrecisionPolicy) -> tuple[int, int]:
    """What FSDP2 gathers of the largest decoder layer: its unsharded weights in the dtype they compute in (packed
    MXFP4 bytes stay bytes), and its unsharded gradients in the reduce dtype."""
    gathered: dict[str, int] = {}
    gradients: dict[str, int] = {}
    for name, param in named:
        layer = _LAYER.match(name)
        if layer is None:
            continue
        numel = _gathered_numel(param)
        computes_in = policy.compute if param.is_floating_point() else param.dtype
        gathered[layer.group(0)] = gathered.get(layer.group(0), 0) + numel * computes_in.itemsize
        if param.requires_grad:
            gradients[layer.group(0)] = gradients.get(layer.group(0), 0) + numel * policy.reduce.itemsize
    largest = max(gathered, key=lambda layer: gathered[layer], default=None)
    return (gathered[largest], gradients.get(largest, 0)) if largest is not None else (0, 0)


_LAYER = re.compile(r"^model\.layers\.\d+\.")
_FSDP_SHARD_AXES = (Axis.FSDP.value, Axis.EFSDP.value, FSDP_CP)


def _gathered_numel(param: nn.Parameter) -> int:
    """Elements of ``param`` once FSDP2 gathers it: its local shard times the sizes of the mesh axes FSDP2 shards it
    over (tp and ep shards stay)."""
    local = local_tensor(param).numel()
    if not isinstance(param, DTensor):
        return local
    mesh = param.device_mesh
    names = mesh.mesh_dim_names or ()
    for dim, (name, placement) in enumerate(zip(names, param.placements, strict=False)):
        if name in _FSDP_SHARD_AXES and placement.is_shard():
            local *= mesh.size(dim)
    return local


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
        trainable=_bytes(local_tensor(p) for p in params if p.requires_grad),
        parameter_elements=sum(local_tensor(p).numel() for p in params),
        trainable_elements=sum(local_tensor(p).numel() for p in params if p.requires_grad),
    )


def _unique(params: Iterable[nn.Parameter]) -> list[nn.Parameter]:
    """Each parameter once (a tied head and embedding are one; pipeline parts hold disjoint ones)."""
    return list({id(p): p for p in params}.values())


def _bytes(tensors: Iterable[Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)
