"""The grouped GEMM seam: one matmul per expert over that expert's contiguous block of rows.

``x [S, K]`` holds rows sorted by expert, ``counts [E]`` how many rows each expert owns, and
``w [E, N, K]`` one weight per expert (``nn.Linear`` layout). The result is ``[S, N]`` with
``y[r] = w[e] @ x[r]`` for the expert ``e`` owning row ``r``.

Two backends, chosen per call by :func:`select_gemm_backend` unless forced:

* ``grouped_mm``: ``torch._grouped_mm``, a single kernel. It runs on CPU for float dtypes and on
  CUDA for bfloat16 from sm80 on, and wants 16-byte-aligned strides and (on CUDA) pointers.
* ``padded``: scatter rows into an ``[E, C, K]`` buffer (``C`` = the largest count), one batched
  matmul, gather back. Correct everywhere, costs one host sync for ``C`` and memory for
  ``E * C`` rows, so it suits the fallback role: odd shapes, fp32 on CUDA.

Neither loops over experts in Python.

Under ``torch.compile`` (compiled decoder blocks), torch traces ``torch._grouped_mm`` only for bfloat16: its
fake-tensor rule refuses float32, which runs in eager on CPU. There the GEMM goes through the custom op
``raymoe::grouped_mm`` (and its two backward ops), one opaque kernel in the graph that calls the same
``torch._grouped_mm``, so a compiled block computes exactly what the eager one does. The padded backend goes through
``raymoe::padded_grouped_mm`` (and its weight-gradient op) there: its host sync for ``C`` runs inside the op, so the
block's graph does not break at it (a break there cuts the block into frames that recompile for every new ``C``).
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple, get_args

import torch
from torch import Tensor

GemmBackend = Literal["auto", "grouped_mm", "padded"]
GEMM_BACKENDS: tuple[str, ...] = get_args(GemmBackend)
_ALIGN_BYTES = 16


def grouped_mm(x_SK: Tensor, w_ENK: Tensor, counts_E: Tensor, backend: GemmBackend = "auto") -> Tensor:
    """``y [S, N]``: row block ``e`` of ``x_SK`` times ``w_ENK[e].T``; ``counts_E`` are the block sizes."""
    if backend == "auto":
        backend = select_gemm_backend(x_SK, w_ENK)
    if backend == "grouped_mm":
        offsets_E = torch.cumsum(counts_E, dim=0, dtype=torch.int32)
        if torch.compiler.is_compiling() and x_SK.dtype != torch.bfloat16:
            traced: Tensor = _traced_grouped_mm(x_SK, w_ENK, offsets_E)
            return traced
        return torch._grouped_mm(x_SK, w_ENK.transpose(-2, -1), offs=offsets_E)
    if backend == "padded":
        if torch.compiler.is_compiling():
            opaque: Tensor = _traced_padded_mm(x_SK, w_ENK, counts_E)
            return opaque
        return _padded_bmm(x_SK, w_ENK, counts_E)
    raise ValueError(f"unknown grouped GEMM backend {backend!r}; choose one of {GEMM_BACKENDS}")


def select_gemm_backend(x_SK: Tensor, w_ENK: Tensor) -> Literal["grouped_mm", "padded"]:
    """``grouped_mm`` where ``torch._grouped_mm`` supports the device, dtype and layout, else ``padded``."""
    return "grouped_mm" if _native_supported(x_SK, w_ENK) else "padded"


def _native_supported(x_SK: Tensor, w_ENK: Tensor) -> bool:
    if not hasattr(torch, "_grouped_mm") or x_SK.dtype != w_ENK.dtype:
        return False
    device = x_SK.device
    if device.type == "cpu":
        dtype_ok = x_SK.dtype in (torch.float32, torch.bfloat16)
    elif device.type == "cuda":
        dtype_ok = x_SK.dtype == torch.bfloat16 and torch.cuda.get_device_capability(device) >= (8, 0)
    else:
        return False
    return dtype_ok and _aligned(x_SK, w_ENK, pointers=device.type == "cuda")


def _aligned(x_SK: Tensor, w_ENK: Tensor, pointers: bool) -> bool:
    """Row-major ``x`` and ``w`` (read transposed, i.e. column-major) with 16-byte row strides.

    ``N`` must be aligned too: the backward pass multiplies the ``[S, N]`` output gradient.
    """
    align = _ALIGN_BYTES // x_SK.element_size()
    strides_ok = (
        w_ENK.shape[1] % align == 0
        and x_SK.stride(-1) == 1
        and w_ENK.stride(-1) == 1
        and x_SK.stride(0) % align == 0
        and w_ENK.stride(-2) % align == 0
        and w_ENK.stride(0) % align == 0
    )
    if not pointers:
        return strides_ok
    return strides_ok and x_SK.data_ptr() % _ALIGN_BYTES == 0 and w_ENK.data_ptr() % _ALIGN_BYTES == 0


def _padded_bmm(x_SK: Tensor, w_ENK: Tensor, counts_E: Tensor) -> Tensor:
    if x_SK.shape[0] == 0:
        return x_SK.new_zeros(0, w_ENK.shape[1])
    slots = _padded_slots(counts_E, x_SK.shape[0])
    y_ECN = torch.bmm(slots.place(x_SK), w_ENK.transpose(1, 2))
    return y_ECN[slots.expert_S, slots.slot_S]


class _PaddedSlots(NamedTuple):
    """Where row ``r`` of an expert-sorted ``[S, *]`` tensor goes in a zero buffer ``[E, C, *]``: ``[expert_S[r],
    slot_S[r]]``, ``C`` the largest count."""

    num_experts: int
    capacity: int
    expert_S: Tensor
    slot_S: Tensor

    def place(self, x_SK: Tensor) -> Tensor:
        """``x_ECK``: the rows of ``x_SK`` in their slots, zeros elsewhere."""
        buffer = x_SK.new_zeros(self.num_experts, self.capacity, x_SK.shape[1])
        return buffer.index_put((self.expert_S, self.slot_S), x_SK)


def _padded_slots(counts_E: Tensor, rows: int) -> _PaddedSlots:
    """The slots of ``rows`` expert-sorted rows, ``counts_E`` per expert (a host sync for ``C``: the buffer's size
    depends on the routing)."""
    num_experts = counts_E.shape[0]
    capacity = int(counts_E.max())
    starts_E = torch.cumsum(counts_E, dim=0) - counts_E
    expert_S = torch.repeat_interleave(torch.arange(num_experts, device=counts_E.device), counts_E, output_size=rows)
    slot_S = torch.arange(rows, device=counts_E.device) - starts_E[expert_S]
    return _PaddedSlots(num_experts, capacity, expert_S, slot_S)


@torch.library.custom_op("raymoe::padded_grouped_mm", mutates_args=())
def _traced_padded_mm(x_SK: Tensor, w_ENK: Tensor, counts_E: Tensor) -> Tensor:
    """The padded backend as one opaque op for the compiler: ``[S, K] x [E, N, K]`` -> ``[S, N]``."""
    return _padded_bmm(x_SK, w_ENK, counts_E)


@_traced_padded_mm.register_fake
def _(x_SK: Tensor, w_ENK: Tensor, counts_E: Tensor) -> Tensor:
    return x_SK.new_empty(x_SK.shape[0], w_ENK.shape[1])


@torch.library.custom_op("raymoe::padded_grouped_mm_weight_grad", mutates_args=())
def _padded_weight_grad(grad_SN: Tensor, x_SK: Tensor, counts_E: Tensor) -> Tensor:
    """``d w [E, N, K]``: ``grad_e^T x_e`` over each expert's rows, through the padded buffers (zero for an expert
    with no rows)."""
    num_experts = counts_E.shape[0]
    if x_SK.shape[0] == 0:
        return x_SK.new_zeros(num_experts, grad_SN.shape[1], x_SK.shape[1])
    slots = _padded_slots(counts_E, x_SK.shape[0])  # one sync for both buffers
    return torch.bmm(slots.place(grad_SN).transpose(1, 2), slots.place(x_SK))


@_padded_weight_grad.register_fake
def _(grad_SN: Tensor, x_SK: Tensor, counts_E: Tensor) -> Tensor:
    return grad_SN.new_empty(counts_E.shape[0], grad_SN.shape[1], x_SK.shape[1])


def _save_inputs(ctx: Any, inputs: tuple[Tensor, Tensor, Tensor], output: Tensor) -> None:
    """Both custom GEMMs' ``setup_context``: their backward reads all three inputs (rows, weights, the grouping)."""
    ctx.save_for_backward(*inputs)


def _padded_backward(ctx: Any, grad_SN: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
    """``d x = grad_e w_e`` (the same op, over the weights transposed) and ``d w = grad_e^T x_e``."""
    x_SK, w_ENK, counts_E = ctx.saved_tensors
    grad_SN = grad_SN.contiguous()
    grad_x = _traced_padded_mm(grad_SN, w_ENK.transpose(1, 2), counts_E) if ctx.needs_input_grad[0] else None
    grad_w = _padded_weight_grad(grad_SN, x_SK, counts_E) if ctx.needs_input_grad[1] else None
    return grad_x, grad_w, None


_traced_padded_mm.register_autograd(_padded_backward, setup_context=_save_inputs)


@torch.library.custom_op("raymoe::grouped_mm", mutates_args=())
def _traced_grouped_mm(x_SK: Tensor, w_ENK: Tensor, offsets_E: Tensor) -> Tensor:
    """``torch._grouped_mm`` as one opaque op for the compiler: ``[S, K] x [E, N, K]`` -> ``[S, N]``."""
    return torch._grouped_mm(x_SK, w_ENK.transpose(-2, -1), offs=offsets_E)


@_traced_grouped_mm.register_fake
def _(x_SK: Tensor, w_ENK: Tensor, offsets_E: Tensor) -> Tensor:
    return x_SK.new_empty(x_SK.shape[0], w_ENK.shape[1])


@torch.library.custom_op("raymoe::grouped_mm_input_grad", mutates_args=())
def _input_grad(grad_SN: Tensor, w_ENK: Tensor, offsets_E: Tensor) -> Tensor:
    """``d x [S, K]``: row block ``e`` of ``grad [S, N]`` times ``w[e]``."""
    return torch._grouped_mm(grad_SN, w_ENK, offs=offsets_E)


@_input_grad.register_fake
def _(grad_SN: Tensor, w_ENK: Tensor, offsets_E: Tensor) -> Tensor:
    return grad_SN.new_empty(grad_SN.shape[0], w_ENK.shape[2])


@torch.library.custom_op("raymoe::grouped_mm_weight_grad", mutates_args=())
def _weight_grad(grad_SN: Tensor, x_SK: Tensor, offsets_E: Tensor) -> Tensor:
    """``d w [E, N, K]``: ``grad_e^T x_e`` over each expert's row block (zero for an expert with no rows)."""
    return torch._grouped_mm(grad_SN.transpose(0, 1), x_SK, offs=offsets_E)


@_weight_grad.register_fake
def _(grad_SN: Tensor, x_SK: Tensor, offsets_E: Tensor) -> Tensor:
    return grad_SN.new_empty(offsets_E.shape[0], grad_SN.shape[1], x_SK.shape[1])


def _backward(ctx: Any, grad_SN: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
    x_SK, w_ENK, offsets_E = ctx.saved_tensors
    grad_SN = grad_SN.contiguous()
    grad_x = _input_grad(grad_SN, w_ENK, offsets_E) if ctx.needs_input_grad[0] else None
    grad_w = _weight_grad(grad_SN, x_SK, offsets_E) if ctx.needs_input_grad[1] else None
    return grad_x, grad_w, None


_traced_grouped_mm.register_autograd(_backward, setup_context=_save_inputs)
