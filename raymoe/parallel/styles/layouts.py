"""Moving activations between layouts at a module boundary, and running a forward on local parameters.

Between styled modules a model passes plain tensors: each rank's *local part* of a global
tensor whose layout over the tp mesh the styles agree on (``Replicate()``, ``Shard(d)``,
``Partial()``). A style changes layouts with :func:`redistribute_local`, which wraps the
local part as a DTensor, lets DTensor's ``redistribute`` issue the collective, and unwraps
it again; DTensor's autograd then gives each collective its backward. Two of them are the
Megatron-style pair every tensor-parallel layer needs::

    all_reduce_backward(x)   forward identity, backward all-reduce   (a replicated input whose
                             consumers on each rank compute only part of its gradient)
    all_reduce_forward(x)    forward all-reduce, backward identity   (partial sums -> the full sum)

When no gradient can flow (inference, or an input that needs none) there is no backward to
build, and the common layout changes call the collective directly on the plain tensor: this
skips the DTensor wrapping, which at decode sizes costs as much as the collective itself
(``benchmarks/tp_boundaries.py``, gloo: a colwise -> rowwise MLP 20% and a gathered lm_head
20-50% faster at 1 token, no difference at 256).
Every other case takes the DTensor path, so the two agree by construction where both exist.

The module's own forward runs on plain local tensors: :func:`swap_parameters` puts
``param.to_local()`` (or anything else) in place of each direct parameter for the duration of
the call, so any forward code works unchanged and the gradients land on the DTensor parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard

from raymoe.parallel.adapters import local_factor, partial_gradient_factors
from raymoe.parallel.sharding import chunk_bounds


def redistribute_local(
    x: Tensor, mesh: DeviceMesh, src: Placement, dst: Placement, *, grad: Placement | None = None
) -> Tensor:
    """This rank's part of ``x`` laid out as ``dst``, given the plain local ``x`` is its part under ``src``.

    A DTensor ``x`` carries its own layout (``src`` is then ignored). ``grad`` is the layout of
    the gradient that will flow back into the result (default ``dst``): ``Partial()`` when the
    consumer on each rank computes only part of it, so the backward sums it over the mesh.
    """
    if not isinstance(x, DTensor):
        if not _gradient_flows(x):
            return _redistribute_plain(x, mesh, src, dst)
        if src == dst and grad is None:
            return x  # the DTensor round trip would be an identity, forward and backward
        x = DTensor.from_local(x, mesh, [src], run_check=False)
    return _via_dtensor(x, dst, grad)


def _via_dtensor(x: DTensor, dst: Placement, grad: Placement | None) -> Tensor:
    if x.placements != (dst,):
        x = x.redistribute(placements=[dst])
    return x.to_local(grad_placements=None if grad is None else [grad])


def _gradient_flows(x: Tensor) -> bool:
    return torch.is_grad_enabled() and x.requires_grad


def _redistribute_plain(x: Tensor, mesh: DeviceMesh, src: Placement, dst: Placement) -> Tensor:
    """The inference fast path: ``x``'s part under ``dst`` by a plain collective (out of place), no autograd."""
    if src == dst:
        return x
    group, parts = mesh.get_group(), mesh.size()
    if src == Partial() and dst == Replicate():
        total = x.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(total, group=group)
        return total
    if isinstance(src, Shard) and dst == Replicate():
        gathered = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(parts)]
        dist.all_gather(gathered, x.contiguous(), group=group)
        return torch.cat(gathered, dim=src.dim)
    if src == Replicate() and isinstance(dst, Shard):
        start, stop = chunk_bounds(x.shape[dst.dim], parts, mesh.get_local_rank())
        return x.narrow(dst.dim, start, stop - start)
    return _via_dtensor(DTensor.from_local(x, mesh, [src], run_check=False), dst, None)


def all_reduce_forward(x: Tensor, mesh: DeviceMesh) -> Tensor:
    """Partial -> Replicate: the sum over the mesh of each rank's ``x``; the gradient passes through unchanged."""
    return redistribute_local(x, mesh, Partial(), Replicate())


def all_reduce_backward(x: Tensor, mesh: DeviceMesh) -> Tensor:
    """``x`` unchanged (Replicate); the gradient flowing back is summed over the mesh."""
    return redistribute_local(x, mesh, Replicate(), Replicate(), grad=Partial())


@contextmanager
def swap_parameters(module: nn.Module, replace: Callable[[str, Tensor], Tensor | None]) -> Iterator[None]:
    """For the duration of the block, ``module``'s direct parameter ``name`` reads as ``replace(name, param)``.

    The originals are put back on exit, also when the forward raises. ``None`` hides a parameter
    (a module like ``nn.Linear`` then skips it, e.g. a bias that must be added once, after a reduction).
    """
    originals = dict(module._parameters)
    try:
        for name, param in originals.items():
            if param is not None:
                # A plain tensor, not an nn.Parameter: it is a view that carries the gradient back to `param`.
                module._parameters[name] = replace(name, param)  # type: ignore[assignment]  # Tensor, not Parameter
        yield
    finally:
        module._parameters.update(originals)


def local_parameters(module: nn.Module) -> AbstractContextManager[None]:
    """Run with each DTensor parameter replaced by its local shard; its gradient comes back with the same placements,
    except a LoRA factor replicated where its base is split: its gradient is summed (raymoe.parallel.adapters)."""
    partial = partial_gradient_factors(module)

    def local(name: str, param: Tensor) -> Tensor:
        if not isinstance(param, DTensor):
            return param
        return local_factor(param) if name in partial else param.to_local()

    return swap_parameters(module, local)
