"""One tensor-parallel input boundary for the colwise projections that share an input (q, k, v; gate and up).

A colwise layer takes its input Replicate and all-reduces the input's gradient in backward, since each rank's
part of it flows only through that rank's output features (:class:`~raymoe.parallel.styles.tensor.ColwiseParallel`).
Three colwise projections of one input all-reduce three gradients that autograd then adds; added first, one
all-reduce gives the same sum::

    x --+-- q_proj (colwise) --          x -- boundary --+-- q_proj --
        +-- k_proj (colwise) --    ->                    +-- k_proj --
        +-- v_proj (colwise) --                          +-- v_proj --
    backward: 3 all-reduces of [B, S, H]    backward: 3 partial gradients added, 1 all-reduce of [B, S, H]

A model names the children that are the only users of its forward's first argument (``input_consumers``,
:mod:`raymoe.models.common.shard_hints`). Where every one of them runs ColwiseParallel's own input boundary over the
mesh, the parent's forward takes the boundary once and the children take their input as it is; anywhere else (a
child left whole, a style with another input layout) each keeps its own.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from raymoe.models.common.shard_hints import INPUT_CONSUMERS_ATTR
from raymoe.parallel.styles import ParallelStyle
from raymoe.parallel.styles.tensor import ColwiseParallel

_SHARED_ATTR = "_raymoe_input_boundary_shared"


def share_input_boundaries(
    model: nn.Module, styled: Iterable[tuple[nn.Module, ParallelStyle]], mesh: DeviceMesh
) -> None:
    """Give each module of ``model`` whose ``input_consumers`` all run ColwiseParallel's input boundary (``styled``:
    the modules whose forward a style of this ``mesh`` wraps) one boundary in its own forward."""
    style_of = {id(module): style for module, style in styled}
    for parent in model.modules():
        children = _colwise_consumers(parent, style_of)
        if not children or getattr(parent, _SHARED_ATTR, False):
            continue
        for child in children:
            ColwiseParallel.leave_input_boundary_to_parent(child)
        _wrap_forward(parent, mesh)


def _colwise_consumers(parent: nn.Module, style_of: dict[int, ParallelStyle]) -> list[nn.Module]:
    """``parent``'s input consumers if every one takes ColwiseParallel's input boundary, else none."""
    children = [getattr(parent, name, None) for name in getattr(parent, INPUT_CONSUMERS_ATTR, ())]
    if all(isinstance(child, nn.Module) and _takes_colwise_boundary(style_of.get(id(child))) for child in children):
        return [child for child in children if isinstance(child, nn.Module)]
    return []


def _takes_colwise_boundary(style: ParallelStyle | None) -> bool:
    """Whether ``style`` turns its module's input into ColwiseParallel's input boundary and nothing else."""
    return (
        isinstance(style, ColwiseParallel)
        and type(style).transform_inputs_pre_forward is ColwiseParallel.transform_inputs_pre_forward
        and type(style).input_boundary is ColwiseParallel.input_boundary
    )


def _wrap_forward(parent: nn.Module, mesh: DeviceMesh) -> None:
    inner = parent.forward

    @functools.wraps(inner)
    def forward(*args: Any, **kwargs: Any) -> Any:
        if not args or not isinstance(args[0], Tensor):
            raise ValueError(
                f"{type(parent).__name__}: its {INPUT_CONSUMERS_ATTR} share one tensor-parallel input boundary, "
                "so its forward needs that input tensor as first argument"
            )
        return inner(ColwiseParallel.input_boundary(args[0], mesh), *args[1:], **kwargs)

    parent.forward = forward
    setattr(parent, _SHARED_ATTR, True)
