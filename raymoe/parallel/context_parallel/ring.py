"""Ring attention over the cp ranks: each rank's queries meet every rank's keys and values as they travel the ring.

Shape legend: ``B`` rows, ``H`` query heads, ``Hkv`` key/value heads, ``c`` tokens of a chunk, ``D`` / ``Dv`` query
and value channels, ``P`` the cp ranks. A rank holds two chunks of every row (:mod:`.chunks`: ``r`` and
``2P - 1 - r``) of ``q [B, H, 2c, D]``, ``k, v [B, Hkv, 2c, D|Dv]``. In step ``i`` it holds the keys and values of
rank ``j = r - i (mod P)`` and attends to them, while the next rank's are already on their way (the exchange is
posted before the step's compute)::

    step        0          1          ...   P - 1
    rank r      kv of r    kv of r-1  ...   kv of r+1        each step: send what it holds to r + 1,
                                                             receive from r - 1

Each pair (query chunk, key chunk) is a *block*: skipped when the keys come after every query (causality) or lie
beyond the window, causal on the diagonal, else whole; a mask is built only where a window cuts it or documents
(packed rows) meet in it. Blocks run a fused SDPA kernel that returns its log-sum-exp; the outputs merge by it::

    lse = logaddexp(lse_a, lse_b)      out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)

Sinks (gpt-oss) are one more block of a single key with value 0 and score ``sink_h``: they only add to ``lse``.
The backward runs the blocks again with the merged ``out`` and ``lse`` (flash attention's backward is exact given
them), and each key/value block's gradient travels the ring with it and arrives home after the last step.
No host sync: which blocks run depends on chunk indices and the window only; masks are device tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from raymoe.models.common.row_attention import AttentionRule
from raymoe.parallel.context_parallel.chunks import HeadTail

_KV_TAG, _GRAD_TAG = 0, 1


@dataclass(frozen=True)
class Block:
    """Query half ``q_half`` (0: the head chunk, 1: the tail) against key half ``k_half`` of the keys held in a step:
    ``causal`` on the diagonal, ``windowed`` where the window hides some pairs."""

    q_half: int
    k_half: int
    q_chunk: int
    k_chunk: int
    causal: bool
    windowed: bool


def step_blocks(chunks: HeadTail, source: int, window: int | None) -> list[Block]:
    """The blocks to compute when this rank holds the keys of cp rank ``source``: every (query chunk, key chunk)
    pair with some visible key, the diagonal (own chunks) first."""
    c = chunks.chunk
    blocks = []
    for q_half, q_chunk in enumerate(chunks.own_chunks):
        for k_half, k_chunk in enumerate(chunks.chunks_of(source)):
            if k_chunk > q_chunk:
                continue  # every key after every query
            nearest = 0 if k_chunk == q_chunk else (q_chunk - k_chunk - 1) * c + 1
            farthest = (q_chunk - k_chunk) * c + c - 1
            if window is not None and nearest >= window:
                continue  # every key beyond the window
            windowed = window is not None and farthest >= window
            blocks.append(Block(q_half, k_half, q_chunk, k_chunk, k_chunk == q_chunk, windowed))
    return sorted(blocks, key=lambda block: not block.causal)


@dataclass(frozen=True)
class RingLayout:
    """What every layer's ring attention of one forward shares: the split, the cp group, the rows' document runs
    (``runs [B, F]``, a run index per token that changes where a document starts; None: one document a row)."""

    chunks: HeadTail
    group: dist.ProcessGroup
    runs_BF: Tensor | None = None

    # Eager inside a compiled block (raymoe.parallel.compiled_blocks): dynamo cannot trace the ring's point-to-point
    # exchanges, and breaking the block's graph inside the ring would compile the pieces between them as frames of
    # their own, each recompiling per block and step. So the block's graph breaks here, once each way, as at token
    # dispatch, and a selectively checkpointed block recomputes the ring as its forward ran it. torch's lazy form of
    # torch.compiler.disable: that one imports torch._dynamo when the class is defined, and the driver, which imports
    # this module and never compiles, would load it (0.6 s more on its 2.8 s import).
    @torch._disable_dynamo
    def attend(self, q_BHSD: Tensor, k_BHSD: Tensor, v_BHSV: Tensor, rule: AttentionRule) -> Tensor:
        """``[B, H, 2c, Dv]``: this rank's queries over every rank's keys (see the module docstring)."""
        out: Tensor = _RingAttention.apply(q_BHSD, k_BHSD, v_BHSV, rule.sinks_Hq, self, rule.scale, rule.window)
        return out

    def block_mask(self, block: Block, window: int | None, device: torch.device, dtype: torch.dtype) -> Tensor | None:
        """The additive mask ``[B | 1, 1, c, c]`` (0 or -inf, in ``dtype``) of ``block``, or None where none is needed
        (a whole block, or a causal diagonal: the kernel's own ``is_causal``)."""
        if self.runs_BF is None and not block.windowed:
            return None
        c = self.chunks.chunk
        q_pos = torch.arange(block.q_chunk * c, (block.q_chunk + 1) * c, device=device)
        k_pos = torch.arange(block.k_chunk * c, (block.k_chunk + 1) * c, device=device)
        distance = q_pos[:, None] - k_pos[None, :]
        allowed = distance >= 0
        if block.windowed and window is not None:
            allowed = allowed & (distance < window)
        allowed_B1cc = allowed[None, None]
        if self.runs_BF is not None:
            runs_q = self.runs_BF[:, block.q_chunk * c : (block.q_chunk + 1) * c]
            runs_k = self.runs_BF[:, block.k_chunk * c : (block.k_chunk + 1) * c]
            allowed_B1cc = allowed_B1cc & (runs_q[:, None, :, None] == runs_k[:, None, None, :])
        return torch.zeros(allowed_B1cc.shape, dtype=dtype, device=device).masked_fill(~allowed_B1cc, float("-inf"))


class _RingAttention(torch.autograd.Function):
    """The ring's forward and backward (see the module docstring); ``sinks [H]`` or None."""

    @staticmethod
    def forward(
        ctx: Any,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        sinks: Tensor | None,
        layout: RingLayout,
        scale: float,
        window: int | None,
    ) -> Tensor:
        chunks, ring = layout.chunks, _Ring(layout.group, layout.chunks)
        c, dv = chunks.chunk, v.shape[-1]
        out = q.new_zeros((*q.shape[:-1], dv), dtype=torch.float32)
        lse = q.new_full(q.shape[:-1], float("-inf"), dtype=torch.float32)
        held = _pack(k, v)
        for step in range(chunks.cp):
            source = ring.source(step)
            incoming = ring.pass_on(held) if step < chunks.cp - 1 else None
            k_j, v_j = _unpack(held, k.shape, v.shape)
            for block in step_blocks(chunks, source, window):
                rows = slice(block.q_half * c, (block.q_half + 1) * c)
                cols = slice(block.k_half * c, (block.k_half + 1) * c)
                mask = layout.block_mask(block, window, q.device, q.dtype)
                block_out, block_lse = _kernel_forward(
                    q[:, :, rows], k_j[:, :, cols], v_j[:, :, cols], mask, block, scale
                )
                if mask is not None:  # a row that sees no key of the block: its kernel lse reads 0, it is -inf
                    block_lse = block_lse.masked_fill(~_sees_a_key(mask), float("-inf"))
                out[:, :, rows], lse[:, :, rows] = _merge(out[:, :, rows], lse[:, :, rows], block_out, block_lse)
            if incoming is not None:
                held = incoming.wait()
        if sinks is not None:
            out, lse = _with_sinks(out, lse, sinks)
        out_q = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out_q, lse, sinks if sinks is not None else torch.empty(0))
        ctx.layout, ctx.scale, ctx.window, ctx.has_sinks = layout, scale, window, sinks is not None
        return out_q

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse, sinks = ctx.saved_tensors
        layout: RingLayout = ctx.layout
        chunks, ring = layout.chunks, _Ring(layout.group, layout.chunks)
        c = chunks.chunk
        grad_out = grad_out.contiguous()
        grad_q = torch.zeros_like(q, dtype=torch.float32)
        held = _pack(k, v)
        carried: _Pending | None = None  # the gradient of the keys held, on its way from the previous rank
        sent: list[_Pending] = []
        for step in range(chunks.cp):
            source = ring.source(step)
            if step > 0:
                carried = ring.receive_grad(_grad_buffer(k, v))
            incoming = ring.pass_on(held) if step < chunks.cp - 1 else None
            k_j, v_j = _unpack(held, k.shape, v.shape)
            grad_k = torch.zeros_like(k_j, dtype=torch.float32)
            grad_v = torch.zeros_like(v_j, dtype=torch.float32)
            for block in step_blocks(chunks, source, ctx.window):
                rows = slice(block.q_half * c, (block.q_half + 1) * c)
                cols = slice(block.k_half * c, (block.k_half + 1) * c)
                mask = layout.block_mask(block, ctx.window, q.device, q.dtype)
                dq, dk, dv = _kernel_backward(
                    grad_out[:, :, rows],
                    q[:, :, rows],
                    k_j[:, :, cols],
                    v_j[:, :, cols],
                    out[:, :, rows],
                    lse[:, :, rows],
                    mask,
                    block,
                    ctx.scale,
                )
                grad_q[:, :, rows] += dq
                grad_k[:, :, cols] += dk
                grad_v[:, :, cols] += dv
            grad_kv = _pack(grad_k, grad_v)
            if carried is not None:
                grad_kv += carried.wait()
            sent.append(ring.send_grad(grad_kv))
            if incoming is not None:
                held = incoming.wait()
        own = ring.receive_grad(_grad_buffer(k, v)).wait()  # this rank's keys, home after the last step
        for pending in sent:
            pending.wait()
        grad_k, grad_v = _unpack(own, k.shape, v.shape)
        grad_sinks = _sink_gradient(grad_out, out, lse, sinks) if ctx.has_sinks else None
        return grad_q.to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype), grad_sinks, None, None, None


def _sees_a_key(mask: Tensor) -> Tensor:
    """``[B | 1, 1, c]``: the rows of an additive ``mask`` that see at least one key."""
    return (mask == 0).any(dim=-1)


def _merge(out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor) -> tuple[Tensor, Tensor]:
    """Two softmax-normalised partial attentions over disjoint keys -> the attention over both (float32)."""
    merged = torch.logaddexp(lse, block_lse)
    seen = merged > float("-inf")  # rows that saw no key yet keep out 0 and lse -inf (no exp(-inf + inf))
    old = torch.where(seen, torch.exp(lse - merged), 0.0)
    new = torch.where(seen, torch.exp(block_lse - merged), 0.0)
    return out * old[..., None] + block_out.float() * new[..., None], merged


def _with_sinks(out: Tensor, lse: Tensor, sinks: Tensor) -> tuple[Tensor, Tensor]:
    """Add each head's sink (one more key, value 0, score ``sink_h``) to the merged attention."""
    sink_11H1 = sinks.float().view(1, -1, 1)
    total = torch.logaddexp(lse, sink_11H1.expand_as(lse))
    return out * torch.exp(lse - total)[..., None], total


def _sink_gradient(grad_out: Tensor, out: Tensor, lse: Tensor, sinks: Tensor) -> Tensor:
    """``d sink_h = -sum_rows p_sink * (dout . out)`` (the sink's value is 0, so only the normaliser moves)."""
    row_dot = (grad_out.float() * out.float()).sum(dim=-1)  # [B, H, S]
    p_sink = torch.exp(sinks.float().view(1, -1, 1) - lse)
    return (-(p_sink * row_dot).sum(dim=(0, 2))).to(sinks.dtype)


# --- the block kernel: a fused SDPA that returns its log-sum-exp ------------------------------------------------------


def _kernel_forward(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, block: Block, scale: float
) -> tuple[Tensor, Tensor]:
    """``(out [B, H, c, Dv], lse [B, H, c] float32)`` of one block."""
    causal = block.causal and mask is None  # a mask holds the diagonal's causality itself
    qp, kp, vp, dv = _same_width(q, k, v)
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            qp, kp, vp, 0.0, causal, attn_mask=mask, scale=scale
        )
    else:
        out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
            qp, _repeat(kp, qp), _repeat(vp, qp), _bias(mask, qp), True, 0.0, causal, scale=scale
        )
        lse = lse[..., : q.shape[2]]  # the kernel pads its rows to a multiple of 32
    return out[..., :dv], lse.float()


def _kernel_backward(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    mask: Tensor | None,
    block: Block,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """One block's ``(dq, dk, dv)`` given the *merged* ``out`` and ``lse`` of its queries (exact: flash attention's
    backward needs only those)."""
    causal = block.causal and mask is None
    qp, kp, vp, dv = _same_width(q, k, v)
    width = qp.shape[-1]
    gp, op = F.pad(grad_out, (0, width - dv)), F.pad(out, (0, width - dv))
    if q.device.type == "cpu":
        dq, dk, dvv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            gp.contiguous(), qp, kp, vp, op.contiguous(), lse.contiguous(), 0.0, causal, attn_mask=mask, scale=scale
        )
    else:
        groups = qp.shape[1] // kp.shape[1]
        seed = torch.zeros((), dtype=torch.int64, device=q.device)
        dq, dk, dvv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            _rows_outer(gp),
            qp,
            _repeat(kp, qp),
            _repeat(vp, qp),
            _bias(mask, qp),
            _rows_outer(op),
            _efficient_lse(lse),
            seed,
            seed,
            0.0,
            [True, True, True, False],
            causal,
            scale=scale,
        )
        if groups > 1:  # sum each kv head's copies
            dk = dk.unflatten(1, (kp.shape[1], groups)).sum(dim=2)
            dvv = dvv.unflatten(1, (kp.shape[1], groups)).sum(dim=2)
    return dq[..., : q.shape[-1]].float(), dk[..., : k.shape[-1]].float(), dvv[..., :dv].float()


def _same_width(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor, int]:
    """The fused kernels take one head width: zero channels added to whichever side is narrower (a zero query/key
    channel adds nothing to a score; a zero value channel is cut from the output). Returns the value width too."""
    d, dv = q.shape[-1], v.shape[-1]
    width = max(d, dv)
    qp = F.pad(q, (0, width - d)) if d < width else q
    kp = F.pad(k, (0, width - d)) if d < width else k
    vp = F.pad(v, (0, width - dv)) if dv < width else v
    return qp.contiguous(), kp.contiguous(), vp.contiguous(), dv


def _repeat(kv: Tensor, q: Tensor) -> Tensor:
    """The memory-efficient CUDA kernel takes no grouped heads: each kv head repeated for its query heads."""
    groups = q.shape[1] // kv.shape[1]
    return kv.repeat_interleave(groups, dim=1) if groups > 1 else kv


def _rows_outer(x: Tensor) -> Tensor:
    """``x [B, H, c, D]`` laid out in memory as ``[B, c, H, D]``, as the memory-efficient CUDA kernel's forward writes
    its output. Its half-precision backward reads the output itself (for the softmax's row sums) at a row stride of
    ``H * D``, whatever the tensor's strides say: an output laid out ``[B, H, c, D]`` gave wrong dq/dk in bf16 and
    an illegal memory access at 8k rows on an H200 (torch 2.11). float32 computes those sums outside the kernel."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def _efficient_lse(lse: Tensor) -> Tensor:
    """The log-sum-exp as the memory-efficient CUDA kernel returns it: rows padded to a multiple of 32 (not on ROCm)."""
    rows = lse.shape[-1]
    padded = rows if torch.version.hip else -(-rows // 32) * 32
    return F.pad(lse, (0, padded - rows)).contiguous()


def _bias(mask: Tensor | None, q: Tensor) -> Tensor | None:
    return None if mask is None else mask.expand(q.shape[0], q.shape[1], -1, -1)


# --- the ring: who sends to whom ------------------------------------------------------------------------------------


def _pack(k: Tensor, v: Tensor) -> Tensor:
    return torch.cat([k.reshape(-1), v.reshape(-1)])


def _unpack(flat: Tensor, k_shape: torch.Size, v_shape: torch.Size) -> tuple[Tensor, Tensor]:
    k_numel = k_shape.numel()
    return flat[:k_numel].view(k_shape), flat[k_numel:].view(v_shape)


def _grad_buffer(k: Tensor, v: Tensor) -> Tensor:
    return torch.empty(k.numel() + v.numel(), dtype=torch.float32, device=k.device)


class _Pending:
    """A posted exchange: ``wait()`` returns the buffer received into (or the one sent)."""

    def __init__(self, works: list[dist.Work], buffer: Tensor) -> None:
        self.works, self.buffer = works, buffer

    def wait(self) -> Tensor:
        for work in self.works:
            work.wait()
        return self.buffer


class _Ring:
    """Point-to-point exchanges with the cp neighbours (``r + 1`` receives what ``r`` sends). Every rank posts them in
    the same order, so NCCL (which matches in order, ignoring tags) pairs them as gloo (which matches by tag) does."""

    def __init__(self, group: dist.ProcessGroup, chunks: HeadTail) -> None:
        self.group, self.rank, self.size = group, chunks.rank, chunks.cp
        self.next, self.previous = (self.rank + 1) % self.size, (self.rank - 1) % self.size

    def source(self, step: int) -> int:
        """The cp rank whose keys this rank holds in ``step``."""
        return (self.rank - step) % self.size

    def pass_on(self, held: Tensor) -> _Pending:
        """Send ``held`` to the next rank; receive the previous rank's into a new buffer."""
        received = torch.empty_like(held)
        works = dist.batch_isend_irecv(
            [
                dist.P2POp(dist.isend, held, group=self.group, group_peer=self.next, tag=_KV_TAG),
                dist.P2POp(dist.irecv, received, group=self.group, group_peer=self.previous, tag=_KV_TAG),
            ]
        )
        return _Pending(works, received)

    def send_grad(self, grad: Tensor) -> _Pending:
        works = dist.batch_isend_irecv(
            [dist.P2POp(dist.isend, grad, group=self.group, group_peer=self.next, tag=_GRAD_TAG)]
        )
        return _Pending(works, grad)

    def receive_grad(self, buffer: Tensor) -> _Pending:
        works = dist.batch_isend_irecv(
            [dist.P2POp(dist.irecv, buffer, group=self.group, group_peer=self.previous, tag=_GRAD_TAG)]
        )
        return _Pending(works, buffer)
