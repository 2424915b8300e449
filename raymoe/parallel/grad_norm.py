"""The gradient norm of a sharded model over both meshes (SPEC TRAIN-2), and clipping by it; before both, the
gradients still pending a sum (a LoRA factor replicated over a mesh its base is split on) are summed.

Gradients are DTensors on the dense mesh (dp_replicate, fsdp, tp), DTensors on the expert mesh
(dp_replicate, efsdp, ep), or plain tensors every rank holds whole. Each layout's squared local
norms are summed with one multi-tensor op and reduced once, over the axes its gradients are
sharded on.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate


def sum_partial_grads(params: list[nn.Parameter]) -> None:
    """Sum, over their mesh, the gradients that came back ``Partial`` (each rank holding its part of the sum: a LoRA
    factor replicated where its base is split, :mod:`raymoe.parallel.adapters`), so they are whole before the norm
    and the optimizer read them: one all-reduce per such gradient, once per step (after every micro-batch)."""
    for param in params:
        grad = param.grad
        if isinstance(grad, DTensor) and any(p.is_partial() for p in grad.placements):
            whole = [Replicate() if p.is_partial() else p for p in grad.placements]
            param.grad = grad.redistribute(grad.device_mesh, whole)


def grad_norm(
    params: list[nn.Parameter], across: dist.ProcessGroup | None = None, device: torch.device | None = None
) -> Tensor:
    """The 2-norm of all gradients as one vector, over both meshes (SPEC TRAIN-2).

    Squares of the local shards are summed with plain tensor ops per layout (mesh, placements);
    each layout's sum is then reduced once, over the mesh axes its gradients are sharded on
    (a sharded axis holds different pieces, a replicated one the same piece). ``across`` (the
    pipeline group) holds the other parameters of the model: its ranks' sums add up. The norm stays on
    ``device`` (a float32 0-d tensor): nothing here waits for the device.
    """
    # (mesh, placements) of a DTensor gradient; None for plain tensors, which every rank holds whole
    locals_by_layout: dict[tuple[DeviceMesh, tuple[Placement, ...]] | None, list[Tensor]] = {}
    for param in params:
        grad = param.grad
        assert grad is not None
        if isinstance(grad, DTensor):
            locals_by_layout.setdefault((grad.device_mesh, grad.placements), []).append(grad.to_local())
        else:
            locals_by_layout.setdefault(None, []).append(grad)
    total = torch.zeros((), dtype=torch.float32, device=device)
    for layout, local_grads in locals_by_layout.items():
        square = torch.stack(torch._foreach_norm(local_grads, 2, dtype=torch.float32)).pow(2).sum()
        if layout is not None:
            mesh, placements = layout
            summed_over = [Replicate() if p.is_replicate() else Partial() for p in placements]
            square = DTensor.from_local(square, mesh, summed_over, run_check=False).full_tensor()
        total = total + square
    if across is not None:
        dist.all_reduce(total, group=across)
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
