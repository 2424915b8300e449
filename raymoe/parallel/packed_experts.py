"""MXFP4-packed expert weights under a parallel layout: the blocks and scales are split as their weight was.

Applied on meta after the TP and EP rules and before FSDP2 (:mod:`raymoe.rank.load`), so every rule, its checks
and the checkpoint slices stay those of the plain weight ``W [E, R, C]``; its placement then carries over::

    W placement      W_blocks [E, R, C/32, 16]      W_scales [E, R, C/32]
    Shard(0)  ep     Shard(0)                        Shard(0)
    Shard(1)  tp     Shard(1) (strided alike)        Shard(1)
    Shard(2)  tp     Shard(2): C/32 groups split     Shard(2)    (C/32 must split: whole groups per rank)

FSDP2 then shards the uint8 tensors like any frozen parameter (over efsdp for experts).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Placement, Shard, distribute_tensor

from raymoe.models.common.mxfp4 import BLOCK_SIZE, BYTES_PER_BLOCK
from raymoe.models.moe.experts import GroupedExperts
from raymoe.models.moe.packed import pack_weight
from raymoe.parallel.sharding import is_strided_shard, num_pieces, shard_dim, strided_shard
from raymoe.parallel.styles.tensor import ShardingStyle

PACKED_WEIGHTS = ("gate_up_proj", "down_proj")


def pack_experts(model: nn.Module) -> None:
    """Replace every expert weight of ``model`` (meta placeholders, plain or DTensor) by MXFP4 blocks and scales
    placed like it; a ``ValueError`` names a weight whose split would cut a group of 32."""
    for path, module in model.named_modules():
        if not isinstance(module, GroupedExperts):
            continue
        for name in PACKED_WEIGHTS:
            weight = module._parameters[name]
            assert weight is not None
            blocks, scales = _packed_placeholders(f"{path}.{name}", weight)
            pack_weight(module, name, blocks, scales)


def _packed_placeholders(path: str, weight: Tensor) -> tuple[Tensor, Tensor]:
    experts, rows, cols = weight.shape
    if cols % BLOCK_SIZE:
        raise ValueError(f"{path} {tuple(weight.shape)}: its input features ({cols}) are no whole MXFP4 groups of 32")
    groups = cols // BLOCK_SIZE
    blocks = torch.empty(experts, rows, groups, BYTES_PER_BLOCK, dtype=torch.uint8, device="meta")
    scales = torch.empty(experts, rows, groups, dtype=torch.uint8, device="meta")
    if not isinstance(weight, DTensor):
        return blocks, scales
    placements = [_carried(path, p, i, weight) for i, p in enumerate(weight.placements)]
    mesh = weight.device_mesh
    return (
        distribute_tensor(blocks, mesh, placements, src_data_rank=None),
        distribute_tensor(scales, mesh, placements, src_data_rank=None),
    )


def _carried(path: str, placement: Placement, mesh_dim: int, weight: DTensor) -> Placement:
    """``placement`` of ``W`` (on mesh dim ``mesh_dim``) as the blocks' and scales' (same tensor dims 0..2)."""
    dim = shard_dim(placement, weight.ndim)
    if dim is None:
        return placement
    check_groups_split(path, tuple(weight.shape), placement, weight.device_mesh.size(mesh_dim))
    return strided_shard(dim, num_pieces(placement)) if is_strided_shard(placement) else Shard(dim)


def check_groups_split(path: str, shape: tuple[int, ...], placement: Placement, mesh_size: int) -> None:
    """A ``ValueError`` when ``placement`` over ``mesh_size`` ranks would cut weight ``path``'s groups of 32."""
    if shard_dim(placement, len(shape)) != len(shape) - 1:
        return
    split, groups = num_pieces(placement) * mesh_size, shape[-1] // BLOCK_SIZE
    if groups % split:
        raise ValueError(
            f"{path} {shape} is split {split} ways along its input features, which MXFP4 packs in {groups} groups "
            f"of {BLOCK_SIZE}: they do not split into {split} equal parts; use fewer tensor-parallel ranks for the "
            "experts (ep_size, or a smaller tp_size)"
        )


def check_packed_layout(model: nn.Module, rules: Mapping[str, str], styles: Mapping[str, object], size: int) -> None:
    """On the driver (``model`` on meta): every rule of one mesh of ``size`` ranks that splits an expert weight
    keeps its MXFP4 groups whole (what :func:`pack_experts` checks on the ranks)."""
    for path, module in model.named_modules():
        if not isinstance(module, GroupedExperts):
            continue
        for name in PACKED_WEIGHTS:
            style = styles.get(rules.get(f"{path}.{name}") or rules.get(path) or "")
            if isinstance(style, ShardingStyle):
                weight = module._parameters[name]
                assert weight is not None
                placement = style.placement_of(module, name, weight)
                check_groups_split(f"{path}.{name}", tuple(weight.shape), placement, size)
