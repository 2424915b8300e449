"""Routed experts stored as fused 3-D weights and computed with one grouped GEMM per projection.

Shape legend: ``T`` tokens, ``K`` experts per token, ``S = T * K`` (token, expert) pairs, ``E``
experts held by this module, ``H`` hidden size, ``I`` expert intermediate size.

Layout (``nn.Linear``'s ``[out, in]`` per expert, so plan keys and tensor-parallel slicing read the same):
``gate_up_proj [E, 2I, H]`` holds each expert's gate and up rows (as halves or interleaved, see
:mod:`raymoe.models.common.activation`) and ``down_proj [E, H, I]``. Families with expert biases (gpt-oss)
add ``gate_up_proj_bias [E, 2I]`` and ``down_proj_bias [E, H]``. Hub checkpoints store experts per
expert, fused, transposed or quantized; the family's hub layout says how, and the checkpoint reader
assembles these shapes at load time.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from raymoe.models.common.activation import SWIGLU, GatedActivation
from raymoe.models.common.lora import expert_factors
from raymoe.models.common.shard_hints import EXPERT_BATCHED_ATTR, OUTPUT_BIAS_ATTR, SHARD_BLOCK_ATTR
from raymoe.models.moe.grouped_mm import GemmBackend, grouped_mm
from raymoe.models.moe.packed import BLOCKS, SCALES, packed_grouped_mm, packed_weights
from raymoe.models.moe.rows import inverse_permutation, move_rows


class GroupedExperts(nn.Module):
    """Gated experts: ``y = down_e(act(gate_up_e(x)))`` for each routed (token, expert) pair (``act``: SwiGLU)."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        bias: bool = False,
        activation: GatedActivation = SWIGLU,
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size  # as built (not this rank's part)
        self.activation = activation
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size)) if bias else None
        self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden_size)) if bias else None
        # Every parameter leads with the expert dim; the down bias is added once per routed pair.
        setattr(self, EXPERT_BATCHED_ATTR, True)
        if bias:
            setattr(self, OUTPUT_BIAS_ATTR, "down_proj_bias")
        if activation.interleaved:  # a tensor-parallel shard of gate_up must hold whole (gate, up) pairs
            setattr(self, SHARD_BLOCK_ATTR, {"gate_up_proj": 2, "gate_up_proj_bias": 2})
        # Which grouped GEMM to use; "auto" picks torch._grouped_mm where it runs (see grouped_mm.py).
        self.gemm_backend: GemmBackend = "auto"

    def forward(self, hidden_TH: Tensor, topk_ids_TK: Tensor, topk_weights_TK: Tensor) -> Tensor:
        """``hidden: [T, H]``, ``topk_ids/topk_weights: [T, K]`` -> ``[T, H]``: each token's weighted expert sum.

        Pairs are sorted by expert so each expert's rows are contiguous, computed by
        :meth:`compute`, weighted, put back in (token, k) order and summed over ``k``.

        A negative id marks a masked pair (expert-parallel masking: another rank's expert, see
        ``raymoe.parallel.styles.expert``). It still runs, on expert ``id mod E``, so shapes stay static, but
        contributes nothing: weight 0, and no gradient to its routing weight.

        Rows move by :func:`~raymoe.models.moe.rows.move_rows` (``index_select``; that module says why).
        """
        num_tokens, top_k = topk_ids_TK.shape
        kept_TK = topk_ids_TK >= 0
        expert_TK = torch.where(kept_TK, topk_ids_TK, topk_ids_TK.remainder(self.num_experts))
        order_S = torch.argsort(expert_TK.reshape(-1), stable=True)
        counts_E = tokens_per_expert(expert_TK, self.num_experts)
        out_SH = self.compute(move_rows(hidden_TH, order_S // top_k), counts_E)
        # Zeroed here, where the pair is known to be masked: a weight zeroed upstream would still get the
        # masked expert's output as its gradient.
        out_SH = out_SH * topk_weights_TK.masked_fill(~kept_TK, 0).reshape(-1).index_select(0, order_S).unsqueeze(-1)
        out_TKH = move_rows(out_SH, inverse_permutation(order_S)).view(num_tokens, top_k, -1)
        return out_TKH.sum(dim=1).to(hidden_TH.dtype)

    def compute(self, x_SH: Tensor, counts_E: Tensor) -> Tensor:
        """``x: [S, H]`` rows grouped by expert (``counts_E[e]`` rows for expert ``e``, in order) -> ``[S, H]``.

        The single seam every expert-parallel mechanism calls once rows are local and grouped.
        """
        gate_up_S2I = self._project(x_SH, "gate_up_proj", counts_E)
        expert_S = _expert_of_rows(counts_E, x_SH.shape[0]) if self.gate_up_proj_bias is not None else None
        if expert_S is not None and self.gate_up_proj_bias is not None:
            gate_up_S2I = gate_up_S2I + self.gate_up_proj_bias[expert_S]
        out_SH = self._project(self.activation(gate_up_S2I), "down_proj", counts_E)
        if expert_S is not None and self.down_proj_bias is not None:
            out_SH = out_SH + self.down_proj_bias[expert_S]
        return out_SH

    def _project(self, x_SK: Tensor, name: str, counts_E: Tensor) -> Tensor:
        """``x [S, in]`` -> ``[S, out]`` through expert weight ``name``, plus its LoRA update when it has one:
        ``s * (x A_e^T) B_e^T`` as two grouped GEMMs over the same rows (rank ``r`` in between)."""
        if name in packed_weights(self):  # frozen MXFP4 blocks + scales (LoRA on gpt-oss)
            blocks, scales = getattr(self, f"{name}{BLOCKS}"), getattr(self, f"{name}{SCALES}")
            out_SN = packed_grouped_mm(x_SK, blocks, scales, counts_E, self.gemm_backend)
        else:
            out_SN = grouped_mm(x_SK, getattr(self, name), counts_E, self.gemm_backend)
        factors = expert_factors(self, name)
        if factors is None:
            return out_SN
        a_ERK, b_ENR, scaling = factors
        low_SR = grouped_mm(x_SK.to(a_ERK.dtype), a_ERK, counts_E, self.gemm_backend)
        return out_SN + (grouped_mm(low_SR, b_ENR, counts_E, self.gemm_backend) * scaling).to(out_SN.dtype)

    def reset_parameters(self, std: float) -> None:
        nn.init.normal_(self.gate_up_proj, std=std)
        nn.init.normal_(self.down_proj, std=std)
        for bias in (self.gate_up_proj_bias, self.down_proj_bias):
            if bias is not None:
                nn.init.zeros_(bias)

    def extra_repr(self) -> str:
        experts, hidden, intermediate = self.num_experts, self.hidden_size, self.intermediate_size
        bias = ", bias" if self.gate_up_proj_bias is not None else ""
        packed = f", packed={list(packed_weights(self))}" if packed_weights(self) else ""
        return (
            f"experts={experts}, hidden={hidden}, intermediate={intermediate}{bias}, activation={self.activation}, "
            f"gemm_backend={self.gemm_backend!r}{packed}"
        )


def _expert_of_rows(counts_E: Tensor, rows: int) -> Tensor:
    """``[S]`` the expert owning each row of an expert-grouped block (``counts_E[e]`` rows each); no host sync."""
    experts_E = torch.arange(counts_E.numel(), device=counts_E.device)
    return torch.repeat_interleave(experts_E, counts_E, output_size=rows)


def tokens_per_expert(topk_ids_TK: Tensor, num_experts: int) -> Tensor:
    """``[E]`` int64 count of (token, expert) pairs per expert; a scatter-add, so no host sync on GPUs."""
    ids_S = topk_ids_TK.reshape(-1)
    return torch.zeros(num_experts, dtype=torch.int64, device=ids_S.device).scatter_add_(
        0, ids_S, torch.ones_like(ids_S)
    )
