"""Routed experts stored as fused 3-D weights and computed with one grouped GEMM per projection.

Shape legend: ``T`` tokens, ``K`` experts per token, ``S = T * K`` (token, expert) pairs, ``E``
experts held by this module, ``H`` hidden size, ``I`` expert intermediate size.

Layout (transformers 5's, so plan keys and tensor-parallel slicing read the same):
``gate_up_proj [E, 2I, H]`` holds each expert's gate rows then its up rows, and
``down_proj [E, H, I]``. The hub stores them per expert (``experts.{e}.gate_proj.weight`` ...);
the checkpoint reader fuses them at load time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from raymoe.models.moe.grouped_mm import GemmBackend, grouped_mm


class GroupedExperts(nn.Module):
    """SwiGLU experts: ``y = down_e(silu(gate_e(x)) * up_e(x))`` for each routed (token, expert) pair."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        # Which grouped GEMM to use; "auto" picks torch._grouped_mm where it runs (see grouped_mm.py).
        self.gemm_backend: GemmBackend = "auto"

    def forward(self, hidden_TH: Tensor, topk_ids_TK: Tensor, topk_weights_TK: Tensor) -> Tensor:
        """``hidden: [T, H]``, ``topk_ids/topk_weights: [T, K]`` -> ``[T, H]``: each token's weighted expert sum.

        Pairs are sorted by expert so each expert's rows are contiguous, computed by
        :meth:`compute`, weighted, put back in (token, k) order and summed over ``k``.

        A negative id marks a masked pair (expert-parallel masking: another rank's expert, see
        ``raymoe.parallel.styles.expert``). It still runs, on expert ``id mod E``, so shapes stay static, but
        contributes nothing: weight 0, and no gradient to its routing weight.
        """
        num_tokens, top_k = topk_ids_TK.shape
        kept_TK = topk_ids_TK >= 0
        expert_TK = torch.where(kept_TK, topk_ids_TK, topk_ids_TK.remainder(self.num_experts))
        order_S = torch.argsort(expert_TK.reshape(-1), stable=True)
        counts_E = tokens_per_expert(expert_TK, self.num_experts)
        out_SH = self.compute(hidden_TH[order_S // top_k], counts_E)
        # Zeroed here, where the pair is known to be masked: a weight zeroed upstream would still get the
        # masked expert's output as its gradient.
        out_SH = out_SH * topk_weights_TK.masked_fill(~kept_TK, 0).reshape(-1)[order_S, None]
        unsort_S = torch.empty_like(order_S).scatter_(0, order_S, torch.arange(order_S.numel(), device=order_S.device))
        return out_SH[unsort_S].view(num_tokens, top_k, -1).sum(dim=1).to(hidden_TH.dtype)

    def compute(self, x_SH: Tensor, counts_E: Tensor) -> Tensor:
        """``x: [S, H]`` rows grouped by expert (``counts_E[e]`` rows for expert ``e``, in order) -> ``[S, H]``.

        The single seam every expert-parallel mechanism calls once rows are local and grouped.
        """
        gate_up_S2I = grouped_mm(x_SH, self.gate_up_proj, counts_E, self.gemm_backend)
        gate_SI, up_SI = gate_up_S2I.chunk(2, dim=-1)
        return grouped_mm(F.silu(gate_SI) * up_SI, self.down_proj, counts_E, self.gemm_backend)

    def reset_parameters(self, std: float) -> None:
        nn.init.normal_(self.gate_up_proj, std=std)
        nn.init.normal_(self.down_proj, std=std)

    def extra_repr(self) -> str:
        experts, two_inter, hidden = self.gate_up_proj.shape
        return f"experts={experts}, hidden={hidden}, intermediate={two_inter // 2}, gemm_backend={self.gemm_backend!r}"


def tokens_per_expert(topk_ids_TK: Tensor, num_experts: int) -> Tensor:
    """``[E]`` int64 count of (token, expert) pairs per expert; a scatter-add, so no host sync on GPUs."""
    ids_S = topk_ids_TK.reshape(-1)
    return torch.zeros(num_experts, dtype=torch.int64, device=ids_S.device).scatter_add_(
        0, ids_S, torch.ones_like(ids_S)
    )
