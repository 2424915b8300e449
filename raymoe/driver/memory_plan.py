"""What ``raymoe.plan`` answers: a :class:`LayoutPlan` per layout (the planned ranks, the step's estimates, whether
it fits) and the :class:`MemoryPlan` of all of them (ranked, as a table, as JSON, with the command that launches the
best). Sizes are bytes; the table prints GB (10^9 bytes, as GPUs are sold)."""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from raymoe.driver.candidate_layouts import layout_name
from raymoe.driver.communication import Communication
from raymoe.rank.contract import RankMemory
from raymoe.spec.activations import StepActivations
from raymoe.spec.config import DistributedConfig
from raymoe.spec.lora import LoraConfig

_MEMORY = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(GB|GiB|MB|MiB|TB|TiB)?\s*$", re.IGNORECASE)
_UNITS = {"gb": 10**9, "gib": 2**30, "mb": 10**6, "mib": 2**20, "tb": 10**12, "tib": 2**40}


def parse_memory(value: str | int) -> int:
    """``"80GB"`` (decimal, as GPUs are sold), ``"80GiB"``, ``"141 GB"``, ``"141"`` (GB) or an int of bytes -> bytes."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    match = _MEMORY.match(value) if isinstance(value, str) else None
    if match is None or float(match.group(1)) <= 0:
        raise ValueError(f"gpu_memory={value!r} must be a positive size like '80GB', '80GiB' or a number of bytes")
    unit = (match.group(2) or "GB").lower()
    return int(float(match.group(1)) * _UNITS[unit])


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


def rank_key(layout: LayoutPlan) -> tuple[int, int, int]:
    tier = 0 if layout.fits else (1 if layout.fits_checkpointed else 2)
    return tier, layout.communication.total, layout.peak


def _listed(modules: tuple[str, ...] | str | None) -> list[str]:
    if modules is None:
        return []
    return [modules] if isinstance(modules, str) else list(modules)


def launch_command(plan: MemoryPlan, layout: LayoutPlan) -> str:
    """The ``examples/finetune.py`` command line of ``layout`` (the activation checkpointing it needs to fit); of a
    pipeline layout, which finetune.py cannot launch, the ``from_pretrained`` call."""
    config = layout.config
    if (config.pp_size or 1) > 1:  # finetune.py has no pipeline flags: the layout as from_pretrained takes it
        sizes = {name: value for name, value in config.to_dict().items() if name.endswith("_size") and value}
        return f"raymoe.from_pretrained({plan.model!r}, distributed_config=raymoe.DistributedConfig(**{sizes!r}))"
    args = ["python", "examples/finetune.py", "--model", plan.model, "--seq-len", str(plan.seq_len)]
    # every size finetune.py has a default for (its DEFAULT_LAYOUT, tp2·fsdp2·ep2) is given, 1 included
    for flag, value in (
        ("--tp-size", config.tp_size),
        ("--fsdp-size", config.fsdp_size),
        ("--ep-size", config.ep_size),
    ):
        args += [flag, str(value or 1)]
    for flag, value in (("--dp-replicate-size", config.dp_replicate_size), ("--cp-size", config.cp_size)):
        if value is not None and value > 1:
            args += [flag, str(value)]
    if layout.expert_mode == "masking":
        args += ["--ep-mode", "masking"]
    if not layout.fits and layout.fits_checkpointed:
        args += ["--activation-checkpointing", "full"]
    for flag in ("precision", "dtype"):
        if plan.options.get(flag):
            args += [f"--{flag}", str(plan.options[flag])]
    lora = plan.options.get("lora")
    if isinstance(lora, str | os.PathLike):
        args += ["--adapter", str(lora)]
    elif isinstance(lora, LoraConfig):
        args += ["--lora-r", str(lora.r), "--lora-alpha", f"{lora.lora_alpha:g}"]
        targets = [*_listed(lora.target_modules), *lora.target_parameters]
        if targets:
            args += ["--lora-targets", *targets]
    if plan.options.get("quantized_experts"):
        args += ["--quantized-experts", str(plan.options["quantized_experts"])]
    return shlex.join(args)


def describe_memory(ranks: Sequence[RankMemory]) -> str:
    """What each rank holds, measured (``model.describe()``), in GB: ranks holding the same bytes share a line."""
    gb = 1e9
    lines = [
        "memory per rank (measured; GB): parameters, of which train (a step's gradients take as much), gradients "
        "held now (between a backward and its step), AdamW states (from the first step)"
    ]
    rows: list[tuple[list[int], tuple[int, int, int, int]]] = []
    for rank in ranks:
        key = (rank.parameters, rank.trainable, rank.gradients, rank.optimizer)
        if rows and rows[-1][1] == key:
            rows[-1][0].append(rank.rank)
        else:
            rows.append(([rank.rank], key))
    for members, (params, trainable, grads, optimizer) in rows:
        who = f"rank {members[0]}" if len(members) == 1 else f"ranks {members[0]}-{members[-1]}"
        lines.append(
            f"  {who}: parameters {params / gb:.3f} (train {trainable / gb:.3f}), gradients {grads / gb:.3f}, "
            f"AdamW {optimizer / gb:.3f}"
        )
    return "\n".join(lines)
