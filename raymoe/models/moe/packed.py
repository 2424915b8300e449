"""Frozen expert weights kept MXFP4-packed (LoRA on gpt-oss): uint8 blocks and scales, dequantized inside forward.

An expert weight ``W [E, R, C]`` of a :class:`~raymoe.models.moe.experts.GroupedExperts` is replaced by two frozen
uint8 parameters in the hub's own layout (:mod:`raymoe.models.common.mxfp4`)::

    W_blocks [E, R, C/32, 16]     two e2m1 codes a byte        4.25 bits a weight with the scales,
    W_scales [E, R, C/32]         one e8m0 exponent per 32     0.27 x the bytes of bf16

Each projection dequantizes its local blocks into the activations' dtype, multiplies, and drops the result;
backward dequantizes again (``torch.utils.checkpoint``: the saved inputs are the packed bytes, never a full-precision
weight), so no dequantized weight outlives its layer's use of it. Dequantization is exact, so the outputs and
gradients are those of the model holding the dequantized weights. A parallel layout splits the packed tensors as it
split ``W`` (dims E, R and the groups of C: :mod:`raymoe.parallel.packed_experts`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from raymoe.models.common.mxfp4 import dequantize_mxfp4
from raymoe.models.common.shard_hints import LORA_FROZEN_ATTR, MXFP4_PACKED_ATTR
from raymoe.models.moe.grouped_mm import GemmBackend, grouped_mm

BLOCKS, SCALES = "_blocks", "_scales"


def packed_weights(module: nn.Module) -> tuple[str, ...]:
    """The expert weights ``module`` holds packed (their ``_blocks`` / ``_scales`` parameters in place)."""
    names: tuple[str, ...] = getattr(module, MXFP4_PACKED_ATTR, ())
    return names


def pack_weight(module: nn.Module, name: str, blocks: Tensor, scales: Tensor) -> None:
    """Replace ``module``'s weight ``name`` by the frozen uint8 ``blocks`` and ``scales`` (placeholders on meta, or
    values); LoRA's record of the frozen base names them in its place."""
    delattr(module, name)
    module.register_parameter(f"{name}{BLOCKS}", nn.Parameter(blocks, requires_grad=False))
    module.register_parameter(f"{name}{SCALES}", nn.Parameter(scales, requires_grad=False))
    setattr(module, MXFP4_PACKED_ATTR, (*packed_weights(module), name))
    frozen = getattr(module, LORA_FROZEN_ATTR, ())
    if name in frozen:
        others = tuple(n for n in frozen if n != name)
        setattr(module, LORA_FROZEN_ATTR, (*others, f"{name}{BLOCKS}", f"{name}{SCALES}"))


def packed_grouped_mm(x_SK: Tensor, blocks: Tensor, scales: Tensor, counts_E: Tensor, backend: GemmBackend) -> Tensor:
    """``x [S, in]`` -> ``[S, out]`` through the packed weight, dequantized into ``x``'s dtype here and, for
    backward, again (checkpointed: only ``x`` and the packed bytes are kept)."""
    out: Tensor = checkpoint(_dequantized_mm, x_SK, blocks, scales, counts_E, backend, use_reentrant=False)
    return out


def _dequantized_mm(x_SK: Tensor, blocks: Tensor, scales: Tensor, counts_E: Tensor, backend: GemmBackend) -> Tensor:
    return grouped_mm(x_SK, dequantize_mxfp4(blocks, scales, dtype=x_SK.dtype), counts_E, backend)


def packed_companions(model: nn.Module) -> dict[str, tuple[str, str]]:
    """``{blocks path: (weight path, scales path)}`` of every packed weight in ``model``."""
    found = {}
    for path, module in model.named_modules():
        for name in packed_weights(module):
            stem = f"{path}.{name}" if path else name
            found[f"{stem}{BLOCKS}"] = (stem, f"{stem}{SCALES}")
    return found


def unpacked_stream(
    tensors: Iterable[tuple[str, Tensor]], companions: dict[str, tuple[str, str]], dtype: torch.dtype
) -> Iterator[tuple[str, Tensor]]:
    """``tensors`` (path, full tensor) with each packed weight's blocks and scales replaced by the weight itself,
    dequantized into ``dtype`` (what a hub checkpoint of the model holds); everything else passes through."""
    scales_of = {scales: blocks for blocks, (_, scales) in companions.items()}
    waiting: dict[str, Tensor] = {}
    for name, tensor in tensors:
        if name in companions or name in scales_of:
            waiting[name] = tensor
            blocks = name if name in companions else scales_of[name]
            scales = companions[blocks][1]
            if blocks in waiting and scales in waiting:
                yield companions[blocks][0], dequantize_mxfp4(waiting.pop(blocks), waiting.pop(scales), dtype)
        else:
            yield name, tensor
    if waiting:
        raise ValueError(f"unpacking MXFP4 experts: {sorted(waiting)[:2]} came without their other half")
