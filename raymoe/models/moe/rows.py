"""Moving token rows between token order and expert order: ``x[index]`` as ``index_select`` (backward
``index_add_``), and the permutation that undoes a move.

Rows move with ``index_select`` rather than indexing by a tensor: indexing's backward is the accumulating
``index_put_``, and on CPU ``index_select``'s gather and backward ran 3-5x as fast (``[8192, 256]`` fp32 rows, 2
threads). The gradient sums the same terms, in an order that may differ; on CUDA ``index_add_`` adds
atomically unless ``torch.use_deterministic_algorithms`` is on.

Under ``torch.compile`` on CPU the moves are kept opaque. Left to inductor's C++ backend, the way back from expert
order (``out[unsort]``, then the sum over each token's ``k`` rows) fuses into one loop that reads rows indirectly and
vectorises along ``k`` rather than along the contiguous hidden dim, and the sort's gather likewise; a compiled step
of the many-small bench shape (64 experts, top-8) ran slower than eager (0.88x). As custom ops the moves stay ATen's
gather and scatter-add kernels and the compiler fuses what lies between them: that step 1.14x as fast compiled,
about level with eager (the median of 5 alternating runs' best steps, 0.297 s against 0.338 s; few-large and
dense-heavy within this machine's noise, README "Compiled blocks")."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def move_rows(x_NH: Tensor, index_S: Tensor) -> Tensor:
    """``x [N, H]`` -> ``x[index]`` ``[S, H]``: ``index_select``; :func:`gather_rows` (opaque to the compiler) when
    ``torch.compile`` traces it on CPU. On CUDA inductor keeps its fused Triton kernel (not measured against)."""
    if torch.compiler.is_compiling() and x_NH.device.type == "cpu":
        gathered: Tensor = gather_rows(x_NH, index_S)  # the custom op's wrapper is typed Any
        return gathered
    return x_NH.index_select(0, index_S)


def inverse_permutation(order: Tensor) -> Tensor:
    """``inverse[order[i]] = i``: moving rows with it undoes a move with ``order``."""
    return torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))


@torch.library.custom_op("raymoe::gather_rows", mutates_args=())
def gather_rows(x_NH: Tensor, index_S: Tensor) -> Tensor:
    """``x [N, H]``, ``index [S]`` (values in ``[0, N)``) -> ``x[index]`` ``[S, H]``, by ``index_select``."""
    return x_NH.index_select(0, index_S)


@gather_rows.register_fake
def _(x_NH: Tensor, index_S: Tensor) -> Tensor:
    return x_NH.new_empty(index_S.shape[0], *x_NH.shape[1:])


@torch.library.custom_op("raymoe::scatter_add_rows", mutates_args=())
def scatter_add_rows(grad_SH: Tensor, index_S: Tensor, rows: int) -> Tensor:
    """The gradient of :func:`gather_rows`: ``[rows, H]`` zeros with each ``grad[s]`` added at row ``index[s]``."""
    return grad_SH.new_zeros(rows, *grad_SH.shape[1:]).index_add_(0, index_S, grad_SH)


@scatter_add_rows.register_fake
def _(grad_SH: Tensor, index_S: Tensor, rows: int) -> Tensor:
    return grad_SH.new_empty(rows, *grad_SH.shape[1:])


def _setup_context(ctx: Any, inputs: tuple[Tensor, Tensor], output: Tensor) -> None:
    x_NH, index_S = inputs
    ctx.save_for_backward(index_S)
    ctx.rows = x_NH.shape[0]


def _backward(ctx: Any, grad_SH: Tensor) -> tuple[Tensor | None, None]:
    (index_S,) = ctx.saved_tensors
    return scatter_add_rows(grad_SH.contiguous(), index_S, ctx.rows) if ctx.needs_input_grad[0] else None, None


gather_rows.register_autograd(_backward, setup_context=_setup_context)
