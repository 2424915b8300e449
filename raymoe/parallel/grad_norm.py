"""The gradient norm of a sharded model over both meshes (SPEC TRAIN-2), and clipping by it; before both, the
gradients still pending a sum (a LoRA factor replicated over a mesh its base is split on) are summed.

Gradients are DTensors on the dense mesh (dp_replicate, fsdp, tp), DTensors on the expert mesh
(dp_replicate, efsdp, ep), or plain tensors every rank holds whole. Squared local norms are summed with
multi-tensor ops, weighted by how many ranks hold each piece, and reduced once over the world.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate


def sum_partial_grads(params: list[nn.Parameter]) -> None:
    """Sum, over their mesh, the gradients that came back ``Partial`` (each rank holding its part of the sum: a LoRA
    factor replicated where its base is split, :mod:`raymoe.parallel.adapters`), so they are whole before the norm
    and the optimizer read them: one all-reduce per such gradient, once per step (after every micro-batch)."""
    for param in params:
        grad = param.grad
        if isinstance(grad, DTensor) and any(p.is_partial() for p in grad.placements):
            whole = [Replicate() if p.is_partial() else p for p in grad.placements]
            param.grad = grad.redistribute(grad.device_mesh, whole)


def grad_norm(params: list[nn.Parameter], stage_ranks: int, device: torch.device | None = None) -> Tensor:
    """The 2-norm of all gradients as one vector, over both meshes and every pipeline stage (SPEC TRAIN-2), with
    one all-reduce over the world.

    A gradient's mesh splits it into ``pieces`` distinct local shards (the product of the sizes of its sharded mesh
    dims; 1 for a plain tensor or a replicated DTensor), and each piece is held by ``stage_ranks / pieces`` ranks
    of the world (``stage_ranks``: the ranks of one pipeline stage, which together hold all of its parameters; the
    rest hold copies, or other stages' parameters). So each rank adds the squares of its local shards times
    ``pieces / stage_ranks``, and the sum over the world counts every piece once::

        tp2/fsdp2/ep2 (4 ranks)   mesh            placements                 pieces  weight
        norm weights              (fsdp,)         Shard                      2       1/2  (a copy per tp rank)
        attention projections     (fsdp, tp)      _StridedShard, Shard       4       1
        experts                   (efsdp, ep)     _StridedShard, Shard       4       1

    One collective instead of one per (mesh, placements) and mesh dim (8 on that layout). The norm stays on
    ``device`` (a float32 0-d tensor): nothing here waits for the device.
    """
    squares: dict[tuple[int, torch.device], list[Tensor]] = {}  # (pieces, device) -> local shards
    for param in params:
        grad = param.grad
        assert grad is not None
        if isinstance(grad, DTensor):
            mesh = grad.device_mesh
            pieces = math.prod(mesh.size(i) for i, p in enumerate(grad.placements) if not p.is_replicate())
            local = grad.to_local()
        else:
            pieces, local = 1, grad
        squares.setdefault((pieces, local.device), []).append(local)
    total = torch.zeros((), dtype=torch.float32, device=device)
    for (pieces, _), local_grads in squares.items():
        square = torch.stack(torch._foreach_norm(local_grads, 2, dtype=torch.float32)).pow(2).sum()
        if square.device != total.device:  # offloaded gradients: their squares are summed on the host
            square = square.to(total.device)
        total = total + square * (pieces / stage_ranks)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(total)
    return total.sqrt()


def clip_grads(params: list[nn.Parameter], norm: Tensor, max_norm: float) -> None:
    """Scale every gradient by ``min(1, max_norm / norm)`` (``norm`` from :func:`grad_norm`), on the device: the
    host never reads the norm. Scaling is elementwise, so each rank scales its local shards."""
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for param in params:
        grad = param.grad
        assert grad is not None
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        local.mul_(scale if local.device == scale.device else scale.to(local.device))  # offloaded: on the host
