"""The layouts ``raymoe.plan`` considers for a number of GPUs, and how a layout is named in its table.

    tp            a divisor of the GPUs of one node (tensor parallelism stays inside a node)
    fsdp          the rest, or with ``nodes > 1`` also the rest of a node and one HSDP replica per node
    ep (MoE)      none; masking (ep = tp: routers mask, experts sum over the tp group); token dispatch (every ep
                  that is a multiple of tp, divides fsdp x tp and the expert count)

Candidates are only proposals: each goes through the same checks as ``from_pretrained`` (``prepare_launch``), and
one that fails them is reported as refused, with the reason.
"""

from __future__ import annotations

from collections.abc import Iterator

from raymoe.models.common.config import ModelConfig
from raymoe.spec.config import DistributedConfig

MASKED_EP_PLAN = {"model.layers.*.mlp.gate": "ep_router", "model.layers.*.mlp.experts": "moe_tp_experts"}


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


def expert_mode_of(layout: DistributedConfig) -> str:
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
