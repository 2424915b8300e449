"""Sharded loading on a rank: build on meta, apply the plans, read only this rank's slices (SPEC RAY-3).

    meta model (the precision policy's master dtype) --TP rules (tp mesh)--> --EP rules (ep mesh)--> --FSDP2-->
        parameters are DTensors on meta whose placements say which slice of each tensor this rank keeps
    --to_empty--> local storage on the rank's device
    --for each parameter--> reader.read(name, block) for the blocks of its slice, copied into place

The styles applied are the instances the launch spec carries (resolved on the driver, custom
ones included); no registry is read here. The checkpoint is checked whole first (missing /
unexpected / wrong-shape tensors), so a bad checkpoint fails before anything is read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch
from torch import Tensor

from raymoe.checkpoint.model_io import open_checkpoint
from raymoe.checkpoint.reader import CheckpointReader
from raymoe.models.common.decoder import CausalLM
from raymoe.models.common.lora import adapter_parameters, is_adapter_name
from raymoe.models.common.shard_hints import FLOAT32_ATTR, float32_modules
from raymoe.models.moe.packed import packed_companions
from raymoe.parallel.activation_checkpoint import apply_activation_checkpointing
from raymoe.parallel.apply import apply_rules
from raymoe.parallel.compiled_blocks import compile_blocks
from raymoe.parallel.context_parallel.split import ContextSplit
from raymoe.parallel.fsdp import FsdpUnits, apply_fsdp
from raymoe.parallel.packed_experts import pack_experts
from raymoe.parallel.pipeline import paths_held, rules_held
from raymoe.parallel.sequence_parallel import TpResidualSplit
from raymoe.parallel.sequence_shares import SequenceShares
from raymoe.parallel.sharding import Block, local_tensor, read_local_shard
from raymoe.parallel.styles import ParallelStyle
from raymoe.rank.adapters import fill_adapters
from raymoe.rank.context import LoadedModel, RankContext
from raymoe.rank.contract import LoadReport
from raymoe.rank.gathered import keep_gathered_weights
from raymoe.rank.pipeline import PipelineStages
from raymoe.rank.runner import StageRunner, WholeModel
from raymoe.spec.compile import backend_of, compiles_on
from raymoe.spec.config import DistributedConfig
from raymoe.spec.launch import DTYPES, LaunchSpec
from raymoe.spec.lora import LoraSpec
from raymoe.spec.plans import ResolvedPlans
from raymoe.spec.precision import PrecisionPolicy, resolve_policy
from raymoe.spec.topology import Axis


def load_shards(ctx: RankContext, spec: LaunchSpec) -> LoadReport:
    """Build, shard and load the model of ``spec`` on this rank, under the spec's layout; kept in ``ctx.loaded``.

    Under pipeline parallelism the rank builds only the parts of its stages (``spec.stages``), each sharded by
    the plan rules it holds, and reads only their parameters.
    """
    ctx.loaded = None  # a model loaded earlier on this world is dropped before the new one takes memory
    ctx.use_layout(spec.topology)
    model = spec.build_meta_model()
    with open_checkpoint(spec.source, model, revision=spec.revision, cache_dir=spec.cache_dir) as reader:
        reader.check(
            {name: param.shape for name, param in model.named_parameters() if not is_adapter_name(name)},
            model_name=type(model).__name__,
        )
        policy = resolve_policy(spec.precision, spec.torch_dtype, reader.dtype("model.embed_tokens.weight"))
        runner = sharded_on_meta(spec, ctx, policy, model)
        keeps_gathered = None
        if uses_fsdp(spec.topology.config, policy):
            keeps_gathered = keep_gathered_weights(
                ctx, list(runner.parts), spec.topology.config.fsdp_reshard_after_forward
            )
        bytes_read = 0
        home = parameter_home(spec.topology.config, ctx.device)
        for part in runner.parts:
            part.to_empty(device=home)
            part.tie_weights()  # to_empty gives every parameter new storage, a tied head its own copy
            bytes_read += _read_shards(part, reader)
            if spec.lora is not None:
                fill_adapters(part, spec.lora)
    ctx.loaded = LoadedModel(runner, spec, policy, shares=sequence_shares(ctx, spec))
    trainable = [local_tensor(p) for part in runner.parts for p in part.parameters() if p.requires_grad]
    frozen = [local_tensor(p) for part in runner.parts for p in part.parameters() if not p.requires_grad]
    return LoadReport(
        ctx.rank,
        bytes_read,
        sum(_bytes_held(part) for part in runner.parts),
        policy,
        trainable_params=sum(t.numel() for t in trainable),
        trainable_bytes=sum(t.numel() * t.element_size() for t in trainable),
        frozen_params=sum(t.numel() for t in frozen),
        keeps_gathered=keeps_gathered,
    )


def parameter_home(config: DistributedConfig, device: torch.device) -> torch.device:
    """Where a rank computing on ``device`` holds its parameter shards: the host under ``fsdp_cpu_offload`` (FSDP2
    copies each unit's shards to the device for its forward and backward, and refuses shards materialised anywhere
    but the CPU), else ``device``. The models hold no buffers: every tensor they own is a parameter."""
    return torch.device("cpu") if config.fsdp_cpu_offload else device


def sharded_on_meta(spec: LaunchSpec, ctx: RankContext, policy: PrecisionPolicy, model: CausalLM) -> StageRunner:
    """The runner of what this rank holds of ``model`` (the spec's meta model), every part still on meta but held in
    the ``policy``'s dtypes and sharded as the spec's layout says: parameters are DTensor placeholders of this rank's
    slices. What :func:`load_shards` fills, and what :func:`raymoe.rank.footprint.planned_memory` counts."""
    runner, pieces = _on_meta(spec, ctx, model)
    for part, plans in pieces:
        hold_in(part, policy, spec.lora)
        shard_on_meta(part, spec, ctx, plans, policy)
    return runner


def sequence_shares(ctx: RankContext, spec: LaunchSpec) -> SequenceShares:
    """How this rank's forwards split sequences: its share of every row over the cp group (context parallelism) and
    the residual stream's share over the tp group (sequence parallelism)."""
    config = spec.topology.config
    context = ContextSplit(ctx.mesh(Axis.CP), config.cp_mode) if config.splits_sequences else None
    residual = TpResidualSplit(ctx.mesh(Axis.TP)) if config.enable_sequence_parallel else None
    return SequenceShares(context, residual)


def hold_in(model: CausalLM, policy: PrecisionPolicy, lora: LoraSpec | None = None) -> None:
    """Give ``model``'s parameters (still on meta) the policy's master dtype, except those the model keeps in
    float32 (:data:`~raymoe.models.common.shard_hints.FLOAT32_ATTR`: a router's selection bias).

    With LoRA the frozen base needs no master copy: it is held in the compute dtype, and the factors (which train)
    in the adapters' own dtype (``LoraConfig.lora_dtype``, float32 by default)."""
    model.to(policy.master if lora is None else policy.compute)
    if lora is not None:
        for _, factor in adapter_parameters(model):
            factor.data = factor.data.to(DTYPES[lora.config.lora_dtype])
    for module in float32_modules(model).values():
        for name in getattr(module, FLOAT32_ATTR):
            getattr(module, name).data = getattr(module, name).data.float()


def _on_meta(
    spec: LaunchSpec, ctx: RankContext, model: CausalLM
) -> tuple[StageRunner, list[tuple[CausalLM, ResolvedPlans]]]:
    """The runner this rank gets (the one place the pipeline / no-pipeline choice is made) and each part it will
    hold, on meta, with the plan rules that part holds."""
    if spec.stages is None:
        return WholeModel(model), [(model, spec.plans)]
    stage_ids = spec.stages.stages_of(ctx.coords.pp)
    parts = tuple(spec.build_meta_part(stage) for stage in stage_ids)
    return PipelineStages(parts, stage_ids, spec.stages), [(part, part_plans(spec.plans, part)) for part in parts]


def part_plans(plans: ResolvedPlans, part: CausalLM) -> ResolvedPlans:
    """``plans`` restricted to what a pipeline stage's ``part`` holds (:mod:`raymoe.parallel.pipeline`)."""
    return dataclasses.replace(
        plans,
        tp_rules=rules_held(plans.tp_rules, part),
        ep_rules=rules_held(plans.ep_rules, part),
        fsdp_rules=rules_held(plans.fsdp_rules, part),
        expert_modules=paths_held(plans.expert_modules, part),
    )


def unload_model(ctx: RankContext) -> None:
    """Drop this rank's model and optimizer; the world and its meshes stay for the next load."""
    ctx.loaded = None


def shard_on_meta(
    model: CausalLM,
    spec: LaunchSpec,
    ctx: RankContext,
    plans: ResolvedPlans | None = None,
    policy: PrecisionPolicy | None = None,
) -> None:
    """TP rules, then EP rules, packed experts (``quantized_experts``), activation checkpointing, compiled blocks
    (``spec.compile``), then FSDP2, on the
    model (or a pipeline stage's part of it, with ``plans`` restricted to that part) while it is still on meta;
    ``policy`` (default: the model's dtypes as they are, computed as held) gives FSDP2 its compute and reduction
    dtypes."""
    plans, config = plans if plans is not None else spec.plans, spec.topology.config
    if plans.tp_rules:
        apply_rules(model, plans.tp_rules, ctx.mesh(Axis.TP), plans.styles)
    if plans.ep_rules:
        apply_rules(model, plans.ep_rules, ctx.mesh(Axis.EP), ep_styles(plans.styles, ctx))
    if spec.quantized_experts is not None:  # placed as the rules placed the plain weights
        pack_experts(model)
    apply_activation_checkpointing(model, config.activation_checkpointing)  # before FSDP2, as its units wrap layers
    if compiles_on(spec.compile, ctx.device):  # the blocks' forwards, under FSDP2's hooks (which stay eager)
        compile_blocks(model, backend_of(spec.compile))
    if uses_fsdp(config, policy):
        units = FsdpUnits(
            dense_mesh=ctx.data_parallel_mesh(Axis.FSDP),
            expert_mesh=ctx.data_parallel_mesh(Axis.EFSDP),
            expert_modules=plans.expert_modules if plans.ep_rules else (),
            # The fsdp_plan's units also without data parallelism (FSDP2 then only casts, for a mixed policy, or wraps
            # the experts): a step gathers one layer at a time, never a second copy of the whole model.
            fsdp_rules=plans.fsdp_rules,
            float32_modules=tuple(float32_modules(model)),
            compute_dtype=policy.compute if policy is not None and policy.mixed else None,
            cpu_offload=config.fsdp_cpu_offload,
            reduce_scatter_by_all_to_all=ctx.backend == "gloo" and ctx.device.type == "cpu",
        )
        apply_fsdp(model, units, ctx.device)


def uses_fsdp(config: DistributedConfig, policy: PrecisionPolicy | None = None) -> bool:
    """FSDP2 wraps the model when there is data parallelism, context parallelism (each cp rank's gradient covers its
    share of the tokens: FSDP2 shards over fsdp x cp and sums them), expert parallelism (experts are always
    wrapped) or something only FSDP honours: a mixed precision policy (its compute casts), CPU offload."""
    mixed = policy is not None and policy.mixed
    sharded = config.dp_size > 1 or config.splits_sequences or (config.ep_size or 1) > 1
    return sharded or mixed or config.fsdp_cpu_offload


def ep_styles(styles: Mapping[str, ParallelStyle], ctx: RankContext) -> dict[str, ParallelStyle]:
    """The spec's styles as this rank applies them over the ep mesh: bound to its tp group when tp > 1 (EP-4)."""
    if ctx.topology.axis_size(Axis.TP) == 1:
        return dict(styles)
    tp_mesh = ctx.mesh(Axis.TP)
    return {name: style.bind_tp(tp_mesh) for name, style in styles.items()}


def _read_shards(model: CausalLM, reader: CheckpointReader) -> int:
    """Fill every parameter's local storage from the checkpoint; returns the bytes read from its files
    (an MXFP4 tensor's packed bytes and scales, not the dequantized values)."""
    start = reader.bytes_read
    packed = {
        part: (weight, role)
        for blocks, (weight, scales) in packed_companions(model).items()
        for part, role in ((blocks, "blocks"), (scales, "scales"))
    }
    for name, param in model.named_parameters():
        if is_adapter_name(name):
            continue  # LoRA factors come from the adapter (raymoe.rank.adapters)

        def read(block: Block, name: str = name) -> Tensor:
            if name in packed:  # the hub's own bytes, not dequantized
                return reader.read_packed(*packed[name], block)
            return reader.read(name, block)

        local = local_tensor(param)
        with torch.no_grad():
            local.copy_(read_local_shard(param, read))
    return reader.bytes_read - start


def _bytes_held(model: CausalLM) -> int:
    return sum(local_tensor(param).numel() * local_tensor(param).element_size() for param in model.parameters())
