"""A sparse MoE feed-forward: route each token, run its experts, sum their weighted outputs."""

from __future__ import annotations

from torch import Tensor, nn

from raymoe.models.common.config import MoeConfig
from raymoe.models.moe.experts import GroupedExperts
from raymoe.models.moe.router import TopKRouter


class SparseMoeBlock(nn.Module):
    """``x [B, S, H]`` -> ``[B, S, H]``. ``gate`` is the router (hub name ``mlp.gate``), ``experts`` the experts."""

    def __init__(self, hidden_size: int, moe: MoeConfig) -> None:
        super().__init__()
        self.gate = TopKRouter(
            hidden_size, moe.num_experts, moe.num_experts_per_tok, moe.norm_topk_prob, selection_bias=moe.selection_bias
        )
        self.experts = GroupedExperts(moe.num_experts, hidden_size, moe.moe_intermediate_size)

    def forward(self, x_BSH: Tensor) -> Tensor:
        hidden_TH = x_BSH.reshape(-1, x_BSH.shape[-1])
        # Each row of the batch is one sequence: the unit of the router's capacity limit.
        topk_ids_TK, topk_weights_TK, _ = self.gate(hidden_TH, sequence_length=x_BSH.shape[1])
        out_TH: Tensor = self.experts(hidden_TH, topk_ids_TK, topk_weights_TK)
        return out_TH.view_as(x_BSH)
