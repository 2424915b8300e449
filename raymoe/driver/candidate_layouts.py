"""The layouts ``raymoe.plan`` considers for a number of GPUs, and how a layout is named in its table.

    tp            a divisor of the GPUs of one node (tensor parallelism stays inside a node)
    fsdp          the rest, or with ``nodes > 1`` also the rest of a node and one HSDP replica per node
    ep (MoE)      none; masking (ep = tp: routers mask, experts sum over the tp group); token dispatch (every ep
                  that is a multiple of tp, divides fsdp x tp and the expert count)

Candidates are only proposals: each goes through the same checks as ``from_pretrained`` (``prepare_launch``), and
one that fails them is reported as refused, with the reason.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import NamedTuple

from torch import nn

from raymoe.models.common.shard_hints import EXPERT_BATCHED_ATTR
from raymoe.models.moe.router import TopKRouter
from raymoe.spec.config import DistributedConfig

ROUTER_MASK, PARTIAL_SUM_EXPERTS = "ep_router", "moe_tp_experts"  # the built-in styles of masked EP


class Candidate(NamedTuple):
    """A layout to plan and the EP mechanism it was made for (``""`` for a layout the user gave: its plans say)."""

    config: DistributedConfig
    expert_mode: str = ""


def masked_ep_plan(model: nn.Module) -> dict[str, str]:
    """The ep_plan of masked expert parallelism for ``model`` (the meta model): the router-masking style on every
    router, the partial-sum experts style on every grouped-experts module, by their paths with ``*`` for the layer
    (``model.layers.*.mlp.gate`` for Qwen3-MoE, ``model.layers.*.mlp.router`` for gpt-oss)."""
    routers = {_any_layer(name) for name, module in model.named_modules() if isinstance(module, TopKRouter)}
    experts = {_any_layer(name) for name, module in model.named_modules() if getattr(module, EXPERT_BATCHED_ATTR, 0)}
    return {**dict.fromkeys(sorted(routers), ROUTER_MASK), **dict.fromkeys(sorted(experts), PARTIAL_SUM_EXPERTS)}


def _any_layer(path: str) -> str:
    return re.sub(r"\.\d+\.", ".*.", path, count=1)


def candidate_layouts(model: nn.Module, num_experts: int | None, gpus: int, nodes: int) -> Iterator[Candidate]:
    """tp (a divisor of the GPUs of a node) x fsdp (the rest, or the rest of a node with one HSDP replica per node),
    and for MoE models (``num_experts``) each EP mechanism that fits: none, masking (ep = tp), token dispatch."""
    per_node = gpus // nodes
    masked = masked_ep_plan(model) if num_experts is not None else {}
    for tp in _divisors(per_node):
        for replicas in sorted({1, nodes}):
            if (gpus // tp) % replicas:
                continue
            fsdp = gpus // tp // replicas
            base = {"tp_size": tp, "fsdp_size": fsdp, "dp_replicate_size": replicas}
            yield Candidate(DistributedConfig(**base), "none")
            if num_experts is None:
                continue
            if tp > 1 and num_experts % tp == 0:
                yield Candidate(DistributedConfig(**base, ep_size=tp, ep_plan=dict(masked)), "masking")
            for ep in _divisors(fsdp * tp):
                if ep > 1 and ep % tp == 0 and num_experts % ep == 0:
                    yield Candidate(DistributedConfig(**base, ep_size=ep), "dispatch")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


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
    return f"{text} ({expert_mode})" if expert_mode not in ("none", "") else text
