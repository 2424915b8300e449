"""How a model parameter is assembled from hub checkpoint tensors.

Most parameters are one hub tensor of the same name. Fused parameters are built from several:
Qwen3-MoE's ``experts.gate_up_proj [E, 2I, H]`` is, for every expert ``e``, the hub's
``experts.{e}.gate_proj.weight [I, H]`` on top of ``experts.{e}.up_proj.weight [I, H]``,
stacked over experts::

    Stack(Concat(gate_0, up_0), Concat(gate_1, up_1), ...)      # [E, 2I, H]

Two more nodes change how a hub tensor is stored rather than how parts are put together::

    Transpose("experts.down_proj")                   # hub [E, I, H] (x @ W) -> model [E, H, I]
    Mxfp4("experts.down_proj_blocks",                # hub uint8 [E, H, I/32, 16] + [E, H, I/32]
          "experts.down_proj_scales")                # -> model [E, H, I], dequantized to bf16

A layout is pure description: the checkpoint reader walks it to read any block of the fused
parameter from the parts, and the writer walks it to split a fused tensor back into parts.
MXFP4 is read only: the writer refuses it (raymoe saves plain tensors).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Stack:
    """Parts of one shape stacked along a new leading dimension (one part per expert)."""

    parts: tuple[HubKeys, ...]


@dataclass(frozen=True)
class Concat:
    """Parts concatenated along ``dim``; they have equal sizes along ``dim``."""

    parts: tuple[HubKeys, ...]
    dim: int = 0


@dataclass(frozen=True)
class Transpose:
    """The part with its last two dims swapped: hub ``[..., A, B]`` is the model's ``[..., B, A]``."""

    part: HubKeys


@dataclass(frozen=True)
class Mxfp4:
    """An MXFP4-quantized hub tensor: uint8 ``blocks [..., R, G, 16]`` and ``scales [..., R, G]`` ->
    ``[..., R, G*32]`` (format: :mod:`raymoe.checkpoint.mxfp4`)."""

    blocks: str
    scales: str


HubKeys = str | Stack | Concat | Transpose | Mxfp4  # a hub tensor name, or a composition of them

# Model parameter name -> where it comes from in the hub checkpoint.
HubLayout = dict[str, HubKeys]


def hub_key_names(keys: HubKeys) -> Iterator[str]:
    """The hub tensor names ``keys`` is made of, in order."""
    if isinstance(keys, str):
        yield keys
    elif isinstance(keys, Transpose):
        yield from hub_key_names(keys.part)
    elif isinstance(keys, Mxfp4):
        yield from (keys.blocks, keys.scales)
    else:
        for part in keys.parts:
            yield from hub_key_names(part)


def split_fused(keys: HubKeys, tensor: Tensor) -> Iterator[tuple[str, Tensor]]:
    """Cut a fused parameter into ``(hub name, tensor)`` parts (views of ``tensor``, or of its transposed copy)."""
    if isinstance(keys, str):
        yield keys, tensor
        return
    if isinstance(keys, Transpose):
        if tensor.dim() < 2:
            raise ValueError(f"cannot transpose {tuple(tensor.shape)} for {next(hub_key_names(keys))!r}: needs 2 dims")
        yield from split_fused(keys.part, tensor.transpose(-2, -1).contiguous())
        return
    if isinstance(keys, Mxfp4):
        raise ValueError(
            f"cannot write {keys.blocks!r}/{keys.scales!r}: raymoe does not write MXFP4 tensors; "
            "save with a layout of plain tensors"
        )
    if isinstance(keys, Stack):
        if tensor.shape[0] != len(keys.parts):
            raise ValueError(f"cannot split {tuple(tensor.shape)} into {len(keys.parts)} stacked parts")
        pieces = tensor.unbind(0)
    else:
        if tensor.shape[keys.dim] % len(keys.parts):
            raise ValueError(f"cannot split {tuple(tensor.shape)} into {len(keys.parts)} equal parts along {keys.dim}")
        pieces = torch.chunk(tensor, len(keys.parts), dim=keys.dim)
    for part, piece in zip(keys.parts, pieces, strict=True):
        yield from split_fused(part, piece)
