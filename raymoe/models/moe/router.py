"""Top-k softmax router.

Shape legend: ``T`` tokens, ``H`` hidden size, ``E`` experts, ``K`` experts per token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from raymoe.models.moe.experts import tokens_per_expert


class TopKRouter(nn.Module):
    """Scores every expert for each token and keeps the ``top_k`` best.

    ``weight [E, H]`` is the hub's ``mlp.gate.weight``. The softmax runs in float32 over all
    experts; with ``norm_topk_prob`` the kept probabilities are renormalised to sum to one.
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, norm_topk_prob: bool) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        # Load statistics for training metrics (SPEC LB-1): tokens per expert of the last forward.
        self.record_load = False
        self.last_load: Tensor | None = None

    def forward(self, hidden_TH: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``hidden: [T, H]`` -> ``(topk_ids [T, K] int64, topk_weights [T, K] in hidden's dtype, logits [T, E])``."""
        logits_TE = F.linear(hidden_TH, self.weight)
        probs_TE = torch.softmax(logits_TE, dim=-1, dtype=torch.float32)
        topk_weights_TK, topk_ids_TK = torch.topk(probs_TE, self.top_k, dim=-1)
        if self.norm_topk_prob:
            topk_weights_TK = topk_weights_TK / topk_weights_TK.sum(dim=-1, keepdim=True)
        if self.record_load:
            self.last_load = tokens_per_expert(topk_ids_TK.detach(), self.num_experts)
        return topk_ids_TK, topk_weights_TK.to(logits_TE.dtype), logits_TE

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, top_k={self.top_k}, norm_topk_prob={self.norm_topk_prob}"
