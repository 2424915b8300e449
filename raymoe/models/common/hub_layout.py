"""How a model parameter is assembled from hub checkpoint tensors.

Most parameters are one hub tensor of the same name. Fused parameters are built from several:
Qwen3-MoE's ``experts.gate_up_proj [E, 2I, H]`` is, for every expert ``e``, the hub's
``experts.{e}.gate_proj.weight [I, H]`` on top of ``experts.{e}.up_proj.weight [I, H]``,
stacked over experts::

    Stack(Concat(gate_0, up_0), Concat(gate_1, up_1), ...)      # [E, 2I, H]

A layout is pure description: the checkpoint reader walks it to read any block of the fused
parameter from the parts, and the writer walks it to split a fused tensor back into parts.
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


HubKeys = str | Stack | Concat  # a hub tensor name, or a composition of them

# Model parameter name -> where it comes from in the hub checkpoint.
HubLayout = dict[str, HubKeys]


def hub_key_names(keys: HubKeys) -> Iterator[str]:
    """The hub tensor names ``keys`` is made of, in order."""
    if isinstance(keys, str):
        yield keys
        return
    for part in keys.parts:
        yield from hub_key_names(part)


def split_fused(keys: HubKeys, tensor: Tensor) -> Iterator[tuple[str, Tensor]]:
    """Cut a fused parameter into ``(hub name, tensor)`` parts (views of ``tensor``)."""
    if isinstance(keys, str):
        yield keys, tensor
        return
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
