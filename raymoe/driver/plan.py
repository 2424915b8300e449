"""Will it fit? ``raymoe.plan``: each layout of a number of GPUs, what every rank holds and the step's peak, from
``config.json`` alone (``raymoe plan`` on the command line).

    config.json (a local directory, or a hub id: only that file is fetched)
        |   for each candidate layout of ``gpus`` (tp within a node x fsdp, x dp_replicate across nodes; MoE models:
        |   no EP, masked EP (ep = tp), token dispatch (every ep that is a multiple of tp dividing fsdp x tp))
        v
    prepare_launch(weights=False)       the layout's every rule checked as from_pretrained checks it (a refused
        |                               layout is listed with its reason)
        v
    worlds.run(planned_memory, ...)     exact: the rank function planned_memory (raymoe.rank.footprint) on each
        |                               simulated rank (raymoe.rank.fake: torch's fake backend), the meta model
        |                               sharded as that rank shards it: parameters, gradients, AdamW states
    estimate_activations                an estimate from the shapes (raymoe.spec.activations), without and with
        |                               full activation checkpointing
    communication_per_step              bytes a rank sends per step, by collective (raymoe.driver.communication)
        v
    MemoryPlan: rows ranked (fits without checkpointing, then fits with it, then the rest; then by communication),
                the best one's launch command

The exact part covers the first rank of each pipeline stage by default, which holds the most (torch's uneven
shards put the larger pieces first); ``all_ranks=True`` plans every rank. Not counted: the CUDA context and
allocator fragmentation (leave a few GB), the Ray worker's own memory, and generation's KV cache.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Protocol, TypeVar

import torch

from raymoe.checkpoint.hub import resolve_config_file
from raymoe.driver.candidate_layouts import Candidate, candidate_layouts, layout_name
from raymoe.driver.communication import communication_per_step
from raymoe.driver.memory_plan import LayoutPlan, MemoryPlan, parse_memory, rank_key
from raymoe.models.common.config import read_config_file
from raymoe.models.registry import build_model, parse_model_config
from raymoe.rank.contract import PlannedRank
from raymoe.rank.footprint import planned_memory
from raymoe.spec.activations import StepActivations, estimate_activations
from raymoe.spec.config import DistributedConfig
from raymoe.spec.launch import DTYPES, LaunchSpec, prepare_launch
from raymoe.spec.lora import LoraConfig
from raymoe.spec.precision import resolve_policy
from raymoe.spec.reshard import keeps_every_unit

DEVICES = ("cuda", "cpu")
PLANS_LOGGER = "raymoe.spec.plans"
T = TypeVar("T")


class SimulatedRanks(Protocol):
    """Ranks of a world of any size, simulated in this process (:class:`raymoe.rank.fake.FakeWorlds`): what the
    plan runs its rank function on."""

    def run(self, world_size: int, ranks: Sequence[int], fn: Callable[..., T], *args: Any) -> list[T]: ...


def plan_memory(
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
    device: str = "cuda",
    worlds: SimulatedRanks,
    revision: str | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
) -> MemoryPlan:
    """Plan ``model`` (a checkpoint directory or hub id; only its ``config.json`` is read) on ``gpus`` GPUs of
    ``gpu_memory`` each (``"80GB"``), ``nodes`` nodes (tp stays inside a node; HSDP replicates across nodes), for a
    global micro-batch of ``batch`` rows of ``seq_len`` tokens (what one forward/backward of a step takes: the
    global batch over gradient accumulation), split over the data-parallel ranks (default: one row each), so
    layouts are compared on the same work. ``lora``, ``quantized_experts``,
    ``precision`` and ``dtype`` as :func:`raymoe.from_pretrained` takes them. ``layouts``: plan these instead of the
    candidates. ``device``: the ranks' device, ``cuda`` or ``cpu`` (where attention kernels differ: the estimate
    counts what each holds). ``worlds``: where the planned ranks are simulated (``raymoe.plan`` and ``raymoe plan``
    give :class:`raymoe.rank.fake.FakeWorlds`). See the module doc; a ``ValueError`` for bad input, before anything
    is planned."""
    budget = parse_memory(gpu_memory)
    if device not in DEVICES:
        raise ValueError(f"device={device!r} must be one of {list(DEVICES)}")
    if isinstance(lora, Mapping):
        lora = LoraConfig(**lora)
    _check_counts(gpus=gpus, nodes=nodes, seq_len=seq_len, batch=batch if batch is not None else 1)
    if gpus % nodes:
        raise ValueError(f"gpus={gpus} must be a multiple of nodes={nodes} (the same number of GPUs on every node)")
    directory = resolve_config_file(model, revision=revision, cache_dir=cache_dir).parent
    raw = read_config_file(directory)
    config = parse_model_config(raw)
    checkpoint_dtype = _checkpoint_dtype(raw)
    num_experts = config.moe.num_experts if config.moe is not None else None
    candidates = (
        [Candidate(layout) for layout in layouts]
        if layouts is not None
        else list(candidate_layouts(build_model(config, device="meta"), num_experts, gpus, nodes))
    )
    planned: list[LayoutPlan] = []
    refused: list[tuple[str, str]] = []
    precision_name = ""
    for layout, mode in candidates:
        try:
            with _quiet(PLANS_LOGGER):  # each layout's "covered by no plan rule" notes: a load's, not a plan's
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
            refused.append((layout_name(layout, mode), " ".join(str(error).split())))
            continue
        policy = resolve_policy(spec.precision, spec.torch_dtype, checkpoint_dtype)
        precision_name = str(policy.precision)
        planned.append(_plan_layout(spec, checkpoint_dtype, budget, seq_len, batch, all_ranks, device, worlds))
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
        layouts=tuple(sorted(planned, key=rank_key)),
        refused=tuple(refused),
        options={"lora": lora, "quantized_experts": quantized_experts, "dtype": dtype, "precision": precision},
    )


@contextmanager
def _quiet(name: str) -> Iterator[None]:
    """Logger ``name`` at ERROR while the block runs, as it was after."""
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


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


def _plan_layout(
    spec: LaunchSpec,
    checkpoint_dtype: torch.dtype,
    budget: int,
    seq_len: int,
    batch: int | None,
    all_ranks: bool,
    device: str,
    worlds: SimulatedRanks,
) -> LayoutPlan:
    topology = spec.topology
    dp = topology.config.dp_size
    rows = -(-batch // dp) if batch is not None else 1  # the most rows a data-parallel rank gets
    planned: list[PlannedRank] = worlds.run(
        topology.world_size, _ranks_to_plan(spec, all_ranks), planned_memory, spec, checkpoint_dtype
    )
    ranks = tuple(p.memory for p in planned)
    gathering = max(planned, key=lambda p: p.layer_gathered)
    policy = resolve_policy(spec.precision, spec.torch_dtype, checkpoint_dtype)
    compute, reduce = policy.compute.itemsize, policy.reduce.itemsize
    config, layout = spec.config, topology.config
    # the ranks decide at load against their free memory: here, an empty device of the budget's size
    kept = max(p.gathered for p in planned)
    keeps = kept > 0 and keeps_every_unit(layout.fsdp_reshard_after_forward, kept, budget)

    def estimate(checkpointing: str) -> StepActivations:
        return estimate_activations(
            config,
            layout.model_copy(update={"activation_checkpointing": checkpointing}),
            seq_len=seq_len,
            rows=rows,
            compute_bytes=compute,
            layer_gathered=gathering.layer_gathered,
            layer_gradients=gathering.layer_gradients,
            kept_gathered=kept if keeps else 0,
            device=device,
        )

    plain, checkpointed = estimate("none"), estimate("full")
    return LayoutPlan(
        config=layout,
        expert_mode=spec.plans.expert_mode,
        ranks=ranks,
        activations=plain,
        activations_checkpointed=checkpointed,
        communication=communication_per_step(
            spec, max(ranks, key=lambda r: r.states), compute, reduce, seq_len, rows, keeps_gathered=keeps
        ),
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
