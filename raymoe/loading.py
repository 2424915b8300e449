"""Sharded loading on a rank: build on meta, apply the plans, read only this rank's slices (SPEC RAY-3).

    meta model --apply tp rules--> DTensor placeholders (placements = this rank's slice)
               --for each parameter--> reader.read(name, block) for the blocks of the slice
               --> local shard on the rank's device, wrapped like the placeholder

The checkpoint is checked whole first (missing / unexpected / wrong-shape tensors), so a bad
checkpoint fails before anything is read.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from raymoe.checkpoint.load import assign_parameter, open_checkpoint
from raymoe.launch import LaunchSpec
from raymoe.models.decoder import CausalLM
from raymoe.parallelize import apply_tp_rules
from raymoe.runtime import RankContext
from raymoe.sharding import Block, read_local_shard, with_local_shard
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
    if spec.plans.tp_rules:
        apply_tp_rules(model, spec.plans.tp_rules, ctx.mesh(Axis.TP))
    bytes_read = 0
    with open_checkpoint(spec.source, model, revision=spec.revision, cache_dir=spec.cache_dir) as reader:
        reader.check({name: param.shape for name, param in model.named_parameters()}, model_name=type(model).__name__)
        for name, placeholder in list(model.named_parameters()):

            def read(block: Block, name: str = name) -> Tensor:
                nonlocal bytes_read
                part = reader.read(name, block)
                bytes_read += part.numel() * part.element_size()
                return part

            dtype = spec.torch_dtype or reader.dtype(name)
            local = read_local_shard(placeholder, read).to(device=ctx.device, dtype=dtype)
            assign_parameter(model, name, with_local_shard(placeholder, local), requires_grad=True)
    model.tie_weights()
    ctx.state["model"] = model
    ctx.state["spec"] = spec
    return LoadReport(ctx.rank, bytes_read, _bytes_held(model))


def rank_model(ctx: RankContext) -> CausalLM:
    model = ctx.state.get("model")
    if not isinstance(model, CausalLM):
        raise RuntimeError("no model is loaded on this rank")
    return model


def _bytes_held(model: CausalLM) -> int:
    total = 0
    for param in model.parameters():
        local = param.to_local() if hasattr(param, "to_local") else param
        total += local.numel() * local.element_size()
    return total
