"""Will it fit? ``raymoe.plan``: each layout of a number of GPUs, what every rank holds and the step's peak, from
``config.json`` alone (``raymoe plan`` on the command line).

    config.json (a local directory, or a hub id: only that file is fetched)
        |   for each candidate layout of ``gpus`` (tp within a node x fsdp, x dp_replicate across nodes; MoE models:
        |   no EP, masked EP (ep = tp), token dispatch (every ep that is a multiple of tp dividing fsdp x tp))
        v
    prepare_launch(weights=False)       the layout's every rule checked as from_pretrained checks it (a refused
        |                               layout is listed with its reason)
        v
    planned_memory(spec, rank)          exact: the meta model sharded in a fake world as each rank shards it
        |                               (raymoe.rank.footprint): parameters, gradients, AdamW states per rank
    estimate_activations                an estimate from the shapes (raymoe.spec.activations), without and with
        |                               full activation checkpointing
    communication_per_step              bytes a rank sends per step, by collective (this module)
        v
    MemoryPlan: rows ranked (fits without checkpointing, then fits with it, then the rest; then by communication),
                the best one's launch command

The exact part covers the first rank of each pipeline stage by default, which holds the most (torch's uneven
shards put the larger pieces first); ``all_ranks=True`` plans every rank. Not counted: the CUDA context and
allocator fragmentation (leave a few GB), the Ray worker's own memory, and generation's KV cache.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from raymoe.checkpoint.hub import resolve_config_file
from raymoe.models.common.config import ModelConfig, read_config_file
from raymoe.models.registry import parse_model_config
from raymoe.rank.contract import RankMemory
from raymoe.rank.footprint import planned_memory
from raymoe.spec.activations import StepActivations, estimate_activations
from raymoe.spec.config import DistributedConfig
from raymoe.spec.launch import DTYPES, LaunchSpec, prepare_launch
from raymoe.spec.lora import LoraConfig
from raymoe.spec.precision import resolve_policy
from raymoe.spec.topology import Axis

MASKED_EP_PLAN = {"model.layers.*.mlp.gate": "ep_router", "model.layers.*.mlp.experts": "moe_tp_experts"}
_MEMORY = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(GB|GiB|MB|MiB|TB|TiB)?\s*$", re.IGNORECASE)
_UNITS = {"gb": 10**9, "gib": 2**30, "mb": 10**6, "mib": 2**20, "tb": 10**12, "tib": 2**40}


def parse_memory(value: str | int) -> int:
    """``"80GB"`` (decimal, as GPUs are sold), ``"80GiB"``, ``"141 GB"`` or a number of bytes -> bytes."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    match = _MEMORY.match(value) if isinstance(value, str) else None
    if match is None or float(match.group(1)) <= 0:
        raise ValueError(f"gpu_memory={value!r} must be a positive size like '80GB', '80GiB' or a number of bytes")
    unit = (match.group(2) or "GB").lower()
    return int(float(match.group(1)) * _UNITS[unit])


@dataclass(frozen=True)
class Communication:
    """Bytes one rank sends in one training step, by collective (an estimate from the layout and the shapes)."""

    fsdp_all_gather: int = 0  # weights gathered in forward and again in backward
    fsdp_reduce_scatter: int = 0  # gradients
    replicate_all_reduce: int = 0  # HSDP: gradients across replicas
    tp_all_reduce: int = 0  # activations at row-parallel outputs (masked EP's partial sums too), forward + backward
    ep_all_to_all: int = 0  # token dispatch and combine, forward + backward
    cp_ring: int = 0  # keys and values around the context-parallel ring, forward + backward

    @property
    def total(self) -> int:
        return (
            self.fsdp_all_gather
            + self.fsdp_reduce_scatter
            + self.replicate_all_reduce
            + self.tp_all_reduce
            + self.ep_all_to_all
            + self.cp_ring
        )


@dataclass(frozen=True)
class LayoutPlan:
    """One layout: the planned ranks (exact), the step's estimates, and whether its peak fits."""

    config: DistributedConfig
    expert_mode: str
    ranks: tuple[RankMemory, ...]
    activations: StepActivations  # without activation checkpointing
    activations_checkpointed: StepActivations  # with full activation checkpointing
    communication: Communication
    gpu_memory: int
    rows: int = 1  # rows of a micro-batch on each data-parallel rank

    @property
    def largest(self) -> RankMemory:
        return max(self.ranks, key=lambda rank: rank.states)

    @property
    def growth(self) -> int:
        """What a step allocates beyond the largest rank's weights and AdamW states at its peak, gradients included
        (:meth:`StepActivations.growth`), without activation checkpointing."""
        return self.activations.growth(self.largest.gradients)

    @property
    def growth_checkpointed(self) -> int:
        return self.activations_checkpointed.growth(self.largest.gradients)

    @property
    def peak(self) -> int:
        """The largest rank's parameters and AdamW states + the step's growth (no checkpointing)."""
        return self.largest.parameters + self.largest.optimizer + self.growth

    @property
    def peak_checkpointed(self) -> int:
        return self.largest.parameters + self.largest.optimizer + self.growth_checkpointed

    @property
    def fits(self) -> bool:
        return self.peak <= self.gpu_memory

    @property
    def fits_checkpointed(self) -> bool:
        return self.peak_checkpointed <= self.gpu_memory

    @property
    def name(self) -> str:
        return layout_name(self.config, self.expert_mode)


@dataclass(frozen=True)
class MemoryPlan:
    """What ``raymoe.plan`` found: every layout that passed its checks, ranked, and those refused (with the reason)."""

    model: str
    model_type: str
    gpus: int
    nodes: int
    gpu_memory: int
    seq_len: int
    batch: int | None  # global rows per micro-batch (None: one per data-parallel rank)
    precision: str
    layouts: tuple[LayoutPlan, ...]
    refused: tuple[tuple[str, str], ...] = ()
    options: Mapping[str, Any] = field(default_factory=dict)

    @property
    def best(self) -> LayoutPlan | None:
        """The first layout that fits (without checkpointing, else with it); None when none does."""
        fitting = [layout for layout in self.layouts if layout.fits or layout.fits_checkpointed]
        return fitting[0] if fitting else None

    def find(self, **sizes: int) -> LayoutPlan:
        """The layout of these sizes (``tp_size=4, fsdp_size=2, ep_size=4``); a KeyError naming what exists."""
        for layout in self.layouts:
            if all(getattr(layout.config, name) == value for name, value in sizes.items()):
                return layout
        raise KeyError(f"no planned layout with {sizes}; planned: {[layout.name for layout in self.layouts]}")

    def command(self, layout: LayoutPlan | None = None) -> str | None:
        """The ``examples/finetune.py`` command that launches ``layout`` (default: the best); None if none fits."""
        chosen = layout if layout is not None else self.best
        return launch_command(self, chosen) if chosen is not None else None

    def to_json(self) -> dict[str, Any]:
        """The plan as plain data (bytes throughout): the request, each layout's ranks and estimates, the refused."""
        return {
            "model": self.model,
            "model_type": self.model_type,
            "gpus": self.gpus,
            "nodes": self.nodes,
            "gpu_memory": self.gpu_memory,
            "seq_len": self.seq_len,
            "batch": self.batch,
            "precision": self.precision,
            "layouts": [
                {
                    "name": layout.name,
                    "config": layout.config.to_dict(),
                    "expert_mode": layout.expert_mode,
                    "rows_per_rank": layout.rows,
                    "ranks": [dataclasses.asdict(rank) for rank in layout.ranks],
                    "activations": dataclasses.asdict(layout.activations),
                    "activations_checkpointed": dataclasses.asdict(layout.activations_checkpointed),
                    "growth": layout.growth,
                    "growth_checkpointed": layout.growth_checkpointed,
                    "peak": layout.peak,
                    "peak_checkpointed": layout.peak_checkpointed,
                    "fits": layout.fits,
                    "fits_checkpointed": layout.fits_checkpointed,
                    "communication": {**dataclasses.asdict(layout.communication), "total": layout.communication.total},
                }
                for layout in self.layouts
            ],
            "refused": [{"name": name, "reason": reason} for name, reason in self.refused],
            "command": self.command(),
        }

    def table(self) -> str:
        """The plan as text: one row per layout (largest rank, GB = 10^9 bytes), the refused ones, the command."""
        gb = 1e9
        head = (
            f"{self.model} ({self.model_type}), {self.gpus} GPU(s) of {self.gpu_memory / gb:.1f} GB"
            f"{f' on {self.nodes} nodes' if self.nodes > 1 else ''}, seq_len {self.seq_len}, "
            f"{f'{self.batch} rows a micro-batch' if self.batch else 'one row per data-parallel rank'}, "
            f"precision {self.precision}"
        )
        header = (
            "| layout | params | grads | AdamW | step growth (none / full ckpt) | peak (none / full ckpt) | fits | "
            "comm/step |"
        )
        lines = [head, "", header, "|---|---|---|---|---|---|---|---|"]
        for layout in self.layouts:
            big = layout.largest
            fits = "yes" if layout.fits else ("with ckpt" if layout.fits_checkpointed else "no")
            lines.append(
                f"| {layout.name} | {big.parameters / gb:.2f} | {big.gradients / gb:.2f} | {big.optimizer / gb:.2f} | "
                f"{layout.growth / gb:.2f} / {layout.growth_checkpointed / gb:.2f} | "
                f"{layout.peak / gb:.2f} / {layout.peak_checkpointed / gb:.2f} | {fits} | "
                f"{layout.communication.total / gb:.2f} |"
            )
        for name, reason in self.refused:
            lines.append(f"refused {name}: {reason}")
        command = self.command()
        lines.append("")
        lines.append(f"best: {command}" if command is not None else "no layout fits: more GPUs, LoRA, or a shorter seq")
        return "\n".join(lines)


def plan(
    model: str | os.PathLike[str],
    *,
    gpus: int,
    gpu_memory: str | int,
    nodes: int = 1,
    seq_len: int = 4096,
    batch: int | None = None,
    lora: LoraConfig | Mapping[str, Any] | str | os.PathLike[str] | None = None,
    quantized_experts: str | None = None,
    precision: str | None = None,
    dtype: str | None = None,
    layouts: Sequence[DistributedConfig] | None = None,
    all_ranks: bool = False,
    revision: str | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
) -> MemoryPlan:
    """Plan ``model`` (a checkpoint directory or hub id; only its ``config.json`` is read) on ``gpus`` GPUs of
    ``gpu_memory`` each (``"80GB"``), ``nodes`` nodes (tp stays inside a node; HSDP replicates across nodes), for a
    global micro-batch of ``batch`` rows of ``seq_len`` tokens (what one forward/backward of a step takes: the
    global batch over gradient accumulation), split over the data-parallel ranks (default: one row each), so
    layouts are compared on the same work. ``lora``, ``quantized_experts``,
    ``precision`` and ``dtype`` as :func:`raymoe.from_pretrained` takes them. ``layouts``: plan these instead of the
    candidates. See the module doc; a ``ValueError`` for bad input, before anything is planned."""
    budget = parse_memory(gpu_memory)
    _check_counts(gpus=gpus, nodes=nodes, seq_len=seq_len, batch=batch if batch is not None else 1)
    if gpus % nodes:
        raise ValueError(f"gpus={gpus} must be a multiple of nodes={nodes} (the same number of GPUs on every node)")
    directory = resolve_config_file(model, revision=revision, cache_dir=cache_dir).parent
    raw = read_config_file(directory)
    config = parse_model_config(raw)
    checkpoint_dtype = _checkpoint_dtype(raw)
    candidates = list(layouts) if layouts is not None else list(candidate_layouts(config, gpus, nodes))
    planned: list[LayoutPlan] = []
    refused: list[tuple[str, str]] = []
    precision_name = ""
    for layout in candidates:
        try:
            spec = prepare_launch(
                directory,
                layout,
                world_size=gpus,
                dtype=dtype,
                precision=precision,
                lora=lora,
                quantized_experts=quantized_experts,
                weights=False,
            )
        except ValueError as error:
            refused.append((layout_name(layout, _mode_of(layout)), " ".join(str(error).split())))
            continue
        policy = resolve_policy(spec.precision, spec.torch_dtype, checkpoint_dtype)
        precision_name = str(policy.precision)
        planned.append(_plan_layout(spec, checkpoint_dtype, budget, seq_len, batch, all_ranks))
    if not planned:
        reasons = "; ".join(f"{name}: {reason}" for name, reason in refused)
        raise ValueError(f"{model}: no layout of {gpus} GPU(s) passes its checks ({reasons or 'none to plan'})")
    return MemoryPlan(
        model=str(model),
        model_type=config.model_type,
        gpus=gpus,
        nodes=nodes,
        gpu_memory=budget,
        seq_len=seq_len,
        batch=batch,
        precision=precision_name,
        layouts=tuple(sorted(planned, key=_rank_key)),
        refused=tuple(refused),
        options={"lora": lora is not None, "quantized_experts": quantized_experts, "dtype": dtype},
    )


def _check_counts(**counts: int) -> None:
    for name, value in counts.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be an int >= 1")


def _checkpoint_dtype(raw: Mapping[str, Any]) -> torch.dtype:
    """The dtype ``config.json`` says the weights are stored in (``dtype``, or transformers 4's ``torch_dtype``;
    float32 when it says nothing, as transformers assumes)."""
    name = raw.get("dtype", raw.get("torch_dtype")) or "float32"
    if name not in DTYPES:
        raise ValueError(f"config.json dtype={name!r}: raymoe holds weights in one of {list(DTYPES)}")
    return DTYPES[name]


def candidate_layouts(config: ModelConfig, gpus: int, nodes: int) -> Iterator[DistributedConfig]:
    """tp (a divisor of the GPUs of a node) x fsdp (the rest, or the rest of a node with one HSDP replica per node),
    and for MoE models each EP mechanism that fits: none, masking (ep = tp), token dispatch."""
    per_node = gpus // nodes
    num_experts = config.moe.num_experts if config.moe is not None else None
    for tp in _divisors(per_node):
        for replicas in sorted({1, nodes}):
            if (gpus // tp) % replicas:
                continue
            fsdp = gpus // tp // replicas
            base = {"tp_size": tp, "fsdp_size": fsdp, "dp_replicate_size": replicas}
            yield DistributedConfig(**base)
            if num_experts is None:
                continue
            if tp > 1 and num_experts % tp == 0:
                yield DistributedConfig(**base, ep_size=tp, ep_plan=dict(MASKED_EP_PLAN))
            for ep in _divisors(fsdp * tp):
                if ep > 1 and ep % tp == 0 and num_experts % ep == 0:
                    yield DistributedConfig(**base, ep_size=ep)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _mode_of(layout: DistributedConfig) -> str:
    if (layout.ep_size or 1) == 1:
        return "none"
    return "masking" if layout.ep_plan and "moe_tp_experts" in layout.ep_plan.values() else "dispatch"


def layout_name(layout: DistributedConfig, expert_mode: str) -> str:
    """``tp4·fsdp2·ep4 (masking)``: the sizes above 1 (``single`` for one rank) and the EP mechanism."""
    sizes = [
        (label, getattr(layout, name) or 1)
        for label, name in (
            ("dp_replicate", "dp_replicate_size"),
            ("pp", "pp_size"),
            ("fsdp", "fsdp_size"),
            ("cp", "cp_size"),
            ("tp", "tp_size"),
            ("ep", "ep_size"),
        )
    ]
    text = "·".join(f"{label}{size}" for label, size in sizes if size > 1) or "single"
    return f"{text} ({expert_mode})" if expert_mode != "none" else text


def _plan_layout(
    spec: LaunchSpec, checkpoint_dtype: torch.dtype, budget: int, seq_len: int, batch: int | None, all_ranks: bool
) -> LayoutPlan:
    topology = spec.topology
    dp = topology.config.dp_size
    rows = -(-batch // dp) if batch is not None else 1  # the most rows a data-parallel rank gets
    ranks = tuple(planned_memory(spec, rank, checkpoint_dtype) for rank in _ranks_to_plan(spec, all_ranks))
    policy = resolve_policy(spec.precision, spec.torch_dtype, checkpoint_dtype)
    compute, reduce = policy.compute.itemsize, policy.reduce.itemsize
    config, layout = spec.config, topology.config
    unsharded = _layer_elements(spec, ranks)
    wrapped = _fsdp_wraps(layout, policy.mixed)

    def estimate(checkpointing: str) -> StepActivations:
        return estimate_activations(
            config,
            layout.model_copy(update={"activation_checkpointing": checkpointing}),
            seq_len=seq_len,
            rows=rows,
            compute_bytes=compute,
            reduce_bytes=reduce,
            layer_param_elements=unsharded,
            fsdp_wrapped=wrapped,
        )

    plain, checkpointed = estimate("none"), estimate("full")
    return LayoutPlan(
        config=layout,
        expert_mode=spec.plans.expert_mode,
        ranks=ranks,
        activations=plain,
        activations_checkpointed=checkpointed,
        communication=communication_per_step(spec, max(ranks, key=lambda r: r.states), compute, reduce, seq_len, rows),
        rows=rows,
        gpu_memory=budget,
    )


def _ranks_to_plan(spec: LaunchSpec, all_ranks: bool) -> list[int]:
    """Every rank, or the first rank of each pipeline stage (coordinates 0 on every other axis)."""
    topology = spec.topology
    if all_ranks:
        return list(range(topology.world_size))
    firsts: dict[int, int] = {}
    for rank, coords in enumerate(topology.ranks):
        others = (coords.dp_replicate, coords.fsdp, coords.cp, coords.tp)
        if not any(others):
            firsts.setdefault(coords.pp, rank)
    return sorted(firsts.values())


def _fsdp_wraps(layout: DistributedConfig, mixed: bool) -> bool:
    sharded = layout.dp_size > 1 or layout.splits_sequences or (layout.ep_size or 1) > 1
    return sharded or mixed or layout.fsdp_cpu_offload


def _layer_elements(spec: LaunchSpec, ranks: Sequence[RankMemory]) -> int:
    """A decoder layer's parameter elements on one rank after TP / EP, before FSDP2 (what it gathers): the rank's
    parameter elements times its FSDP2 shard degree, per layer it holds (an average over them)."""
    topology = spec.topology
    degree = topology.axis_size(Axis.FSDP) * topology.axis_size(Axis.CP)
    layers = spec.config.num_hidden_layers / topology.axis_size(Axis.PP)
    largest = max(ranks, key=lambda rank: rank.parameter_elements)
    return round(largest.parameter_elements * degree / max(layers, 1))


def communication_per_step(
    spec: LaunchSpec, rank: RankMemory, compute_bytes: int, reduce_bytes: int, seq_len: int, rows: int
) -> Communication:
    """Bytes one rank sends per step, by collective: ring collectives send ``(n - 1) / n`` of their buffer (twice
    for an all-reduce); FSDP2 gathers each layer in forward and again in backward, reduce-scatters its gradients."""
    topology, config = spec.topology, spec.config
    layout = topology.config
    tp, cp, ep = topology.axis_size(Axis.TP), topology.axis_size(Axis.CP), layout.ep_size or 1
    shard = topology.axis_size(Axis.FSDP) * cp
    replicas = topology.axis_size(Axis.DP_REPLICATE)
    layers = config.num_hidden_layers / topology.axis_size(Axis.PP)
    tokens = rows * seq_len / cp
    hidden = config.hidden_size
    gathered = rank.parameter_elements * shard * compute_bytes  # the whole (tp / ep share of the) model, gathered
    grads = rank.trainable_elements * shard * reduce_bytes
    moe_layers = sum(config.layer_is_sparse(i) for i in range(config.num_hidden_layers)) / topology.axis_size(Axis.PP)
    top_k = config.moe.num_experts_per_tok if config.moe is not None else 0
    kv_width = 2 * config.num_key_value_heads * config.head_dim / tp
    return Communication(
        fsdp_all_gather=round(2 * gathered * _ring(shard)) if shard > 1 else 0,
        fsdp_reduce_scatter=round(grads * _ring(shard)) if shard > 1 else 0,
        replicate_all_reduce=round(2 * grads / shard * _ring(replicas)) if replicas > 1 else 0,
        tp_all_reduce=round(4 * layers * 2 * tokens * hidden * compute_bytes * _ring(tp)) if tp > 1 else 0,
        ep_all_to_all=round(4 * moe_layers * tokens * top_k * hidden * compute_bytes * _ring(ep))
        if spec.plans.expert_mode == "dispatch"
        else 0,
        cp_ring=round(3 * layers * (cp - 1) * tokens * kv_width * compute_bytes) if cp > 1 else 0,
    )


def _ring(n: int) -> float:
    return (n - 1) / n


def _rank_key(layout: LayoutPlan) -> tuple[int, int, int]:
    tier = 0 if layout.fits else (1 if layout.fits_checkpointed else 2)
    return tier, layout.communication.total, layout.peak


def launch_command(plan: MemoryPlan, layout: LayoutPlan) -> str:
    """The ``examples/finetune.py`` command line of ``layout`` (the activation checkpointing it needs to fit)."""
    config = layout.config
    args = ["python", "examples/finetune.py", "--model", plan.model, "--seq-len", str(plan.seq_len)]
    for flag, value in (
        ("--tp-size", config.tp_size),
        ("--fsdp-size", config.fsdp_size),
        ("--ep-size", config.ep_size),
        ("--dp-replicate-size", config.dp_replicate_size),
        ("--cp-size", config.cp_size),
    ):
        if value is not None and value > 1:
            args += [flag, str(value)]
    if layout.expert_mode == "masking":
        args += ["--ep-mode", "masking"]
    if not layout.fits and layout.fits_checkpointed:
        args += ["--activation-checkpointing", "full"]
    if plan.options.get("quantized_experts"):
        args += ["--quantized-experts", str(plan.options["quantized_experts"])]
    return shlex.join(args)
