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

    Fp8Block("q_b_proj.weight",                      # hub float8_e4m3fn [R, C] + float32 [R/128, C/128]
             "q_b_proj.weight_scale_inv")            # -> model [R, C] = fp8 * scale of its 128x128 block

A layout is pure description: the checkpoint reader walks it to read any block of the fused
parameter from the parts, and the writer walks it to split a fused tensor back into parts.
MXFP4 and FP8 are read only: the writer refuses them (raymoe saves plain tensors).
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
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


@dataclass(frozen=True)
class Fp8Block:
    """A block-scaled FP8 hub tensor (DeepSeek-V3, Kimi-K2): ``weight`` float8_e4m3fn ``[R, C]`` and
    ``scale_inv`` ``[ceil(R / br), ceil(C / bc)]`` for blocks of ``block = (br, bc)``; the value is the fp8
    number times its block's scale (format: :mod:`raymoe.checkpoint.fp8`)."""

    weight: str
    scale_inv: str
    block: tuple[int, int] = (128, 128)


HubKeys = str | Stack | Concat | Transpose | Mxfp4 | Fp8Block  # a hub tensor name, or a composition of them

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
    elif isinstance(keys, Fp8Block):
        yield from (keys.weight, keys.scale_inv)
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
    if isinstance(keys, Fp8Block):
        raise ValueError(
            f"cannot write {keys.weight!r}/{keys.scale_inv!r}: raymoe does not write FP8 tensors; "
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


def per_expert_layout(prefix: str, num_experts: int) -> HubLayout:
    """Fused ``{prefix}.gate_up_proj [E, 2I, H]`` / ``{prefix}.down_proj [E, H, I]`` from the hub's per-expert
    ``{prefix}.{e}.gate_proj / up_proj / down_proj.weight`` (Qwen2/3-MoE, GLM-4.5, DeepSeek-V3)."""
    experts = range(num_experts)
    return {
        f"{prefix}.gate_up_proj": Stack(
            tuple(Concat((f"{prefix}.{e}.gate_proj.weight", f"{prefix}.{e}.up_proj.weight")) for e in experts)
        ),
        f"{prefix}.down_proj": Stack(tuple(f"{prefix}.{e}.down_proj.weight" for e in experts)),
    }


def is_extra_layer_key(key: str, num_layers: int) -> bool:
    """A tensor of a layer past the model's ``num_layers``: the multi-token-prediction layers DeepSeek-V3 and
    GLM-4.5 checkpoints ship after the decoder (``num_nextn_predict_layers``), which inference does not use."""
    parts = key.split(".")
    return len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit() and int(parts[2]) >= num_layers


def fp8_block_layout(layout: HubLayout, available: Collection[str], block: tuple[int, int]) -> HubLayout:
    """``layout`` with every hub tensor ``X`` that has a ``X_scale_inv`` beside it in ``available`` read as
    :class:`Fp8Block` (inside stacks and concatenations too): a block-scaled FP8 checkpoint."""

    def convert(keys: HubKeys) -> HubKeys:
        if isinstance(keys, str):
            scale = f"{keys}_scale_inv"
            return Fp8Block(keys, scale, block) if scale in available else keys
        if isinstance(keys, Stack):
            return Stack(tuple(convert(part) for part in keys.parts))
        if isinstance(keys, Concat):
            return Concat(tuple(convert(part) for part in keys.parts), keys.dim)
        if isinstance(keys, Transpose):
            return Transpose(convert(keys.part))
        return keys

    return {name: convert(keys) for name, keys in layout.items()}
