"""Activation checkpointing of the decoder layers: keep less of the forward for backward, recompute the rest.

Applied per decoder layer with torch's composable ``checkpoint`` (hooks, no wrapper module, so parameter
names stay the hub's), before FSDP2 wraps the layers, as torchtitan does::

    none        every activation kept (fastest, most memory)
    full        a layer keeps only its input; its whole forward runs again in backward
    selective   a layer keeps the outputs of its matmuls, grouped expert GEMMs and attention; the cheap rest
                (norms, activations, rotary, routing softmax, elementwise) runs again in backward

The recomputed forward is the same computation, so gradients equal those without checkpointing.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed._composable import checkpoint
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from raymoe.models.common.decoder import CausalLM

MODES = ("none", "full", "selective")

_aten = torch.ops.aten
# What selective checkpointing keeps: the expensive outputs (recomputing them costs as much as the forward).
SAVED_OPS: frozenset[Any] = frozenset(
    op
    for op in (
        _aten.mm.default,
        _aten.addmm.default,
        _aten.bmm.default,
        getattr(_aten, "_grouped_mm", None),
        _aten._scaled_dot_product_flash_attention.default,
        _aten._scaled_dot_product_efficient_attention.default,
        _aten._scaled_dot_product_flash_attention_for_cpu.default,
        getattr(_aten, "_scaled_dot_product_cudnn_attention", None),
    )
    if op is not None
)


def _keeps(op: Any) -> bool:
    return op in SAVED_OPS or getattr(op, "overloadpacket", None) in SAVED_OPS


def _policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if _keeps(op) else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts() -> Any:
    return create_selective_checkpoint_contexts(_policy)


def apply_activation_checkpointing(model: CausalLM, mode: str) -> None:
    """Checkpoint every decoder layer of ``model`` in ``mode`` (one of :data:`MODES`); "none" leaves it as it is."""
    if mode not in MODES:
        raise ValueError(f"activation_checkpointing={mode!r}: choose one of {', '.join(MODES)}")
    if mode == "none":
        return
    for index in model.kept_layers():
        layer = model.model.layers[index]
        if mode == "selective":
            checkpoint(layer, context_fn=_selective_contexts)
        else:
            checkpoint(layer)
