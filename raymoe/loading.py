"""Sharded loading on a rank: build on meta, apply the plans, read only this rank's slices (SPEC RAY-3).

    meta model (checkpoint dtype) --TP rules (tp mesh)--> --EP rules (ep mesh)--> --FSDP2-->
        parameters are DTensors on meta whose placements say which slice of each tensor this rank keeps
    --to_empty--> local storage on the rank's device
    --for each parameter--> reader.read(name, block) for the blocks of its slice, copied into place

The checkpoint is checked whole first (missing / unexpected / wrong-shape tensors), so a bad
checkpoint fails before anything is read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from raymoe.checkpoint.load import open_checkpoint
from raymoe.checkpoint.reader import CheckpointReader
from raymoe.fsdp import apply_fsdp, uses_fsdp
from raymoe.launch import LaunchSpec
from raymoe.models.decoder import CausalLM
from raymoe.parallelize import apply_tp_rules
from raymoe.plans import DISPATCH_STYLE
from raymoe.runtime import RankContext
from raymoe.sharding import Block, read_local_shard
from raymoe.styles import STYLES, StyleRegistry
from raymoe.styles.expert import EpDispatchExpertsParallel
from raymoe.topology import Axis


@dataclass(frozen=True)
class LoadReport:
    """What one rank read: bytes requested from the checkpoint, and the bytes of its local parameters."""

    rank: int
    bytes_read: int
    bytes_held: int


def load_on_rank(ctx: RankContext, spec: LaunchSpec) -> LoadReport:
    """Build, shard and load the model of ``spec`` on this rank; it is kept in ``ctx.state["model"]``."""
    model = spec.build_meta_model()
    with open_checkpoint(spec.source, model, revision=spec.revision, cache_dir=spec.cache_dir) as reader:
        reader.check({name: param.shape for name, param in model.named_parameters()}, model_name=type(model).__name__)
        model.to(spec.torch_dtype or reader.dtype("model.embed_tokens.weight"))
        shard_on_meta(model, spec, ctx)
        model.to_empty(device=ctx.device)
        bytes_read = _read_shards(model, reader)
    ctx.state["model"] = model
    ctx.state["spec"] = spec
    return LoadReport(ctx.rank, bytes_read, _bytes_held(model))


def shard_on_meta(model: CausalLM, spec: LaunchSpec, ctx: RankContext) -> None:
    """TP rules, then EP rules, then FSDP2, on the model while it is still on the meta device."""
    registry = rank_registry(ctx)
    if spec.plans.tp_rules:
        apply_tp_rules(model, spec.plans.tp_rules, ctx.mesh(Axis.TP), registry)
    if spec.plans.ep_rules:
        apply_tp_rules(model, spec.plans.ep_rules, ctx.mesh(Axis.EP), registry)
    if uses_fsdp(ctx.topology.config):
        apply_fsdp(model, spec.plans, ctx)


def rank_registry(ctx: RankContext) -> StyleRegistry:
    """The global styles, with the token-dispatch style bound to this rank's tp mesh (it slices rows over tp)."""
    if ctx.topology.axis_size(Axis.TP) == 1 or DISPATCH_STYLE not in STYLES:
        return STYLES
    registry = STYLES.copy()
    registry.register(DISPATCH_STYLE, EpDispatchExpertsParallel(tp_mesh=ctx.mesh(Axis.TP)), replace=True)
    return registry


def _read_shards(model: CausalLM, reader: CheckpointReader) -> int:
    """Fill every parameter's local storage from the checkpoint; returns the bytes read."""
    bytes_read = 0
    for name, param in model.named_parameters():

        def read(block: Block, name: str = name) -> Tensor:
            nonlocal bytes_read
            part = reader.read(name, block)
            bytes_read += part.numel() * part.element_size()
            return part

        local = param.to_local() if isinstance(param, DTensor) else param
        with torch.no_grad():
            local.copy_(read_local_shard(param, read))
    return bytes_read


def rank_model(ctx: RankContext) -> CausalLM:
    model = ctx.state.get("model")
    if not isinstance(model, CausalLM):
        raise RuntimeError("no model is loaded on this rank")
    return model


def _bytes_held(model: CausalLM) -> int:
    total = 0
    for param in model.parameters():
        local = param.to_local() if isinstance(param, DTensor) else param
        total += local.numel() * local.element_size()
    return total
