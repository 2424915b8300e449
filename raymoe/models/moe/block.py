"""A sparse MoE feed-forward: route each token, run its experts, sum their weighted outputs."""

from __future__ import annotations

from torch import Tensor, nn

from raymoe.models.common.config import MoeConfig
from raymoe.models.moe.experts import GroupedExperts
from raymoe.models.moe.router import TopKRouter


class SparseMoeBlock(nn.Module):
    """``x [B, S, H]`` -> ``[B, S, H]``: a router and ``experts``.

    The router's attribute is the hub's module name: ``gate`` (``mlp.gate``: Qwen3-MoE, Mixtral) or
    ``router`` (``mlp.router``: gpt-oss); ``router_name`` picks it.
    """

    def __init__(self, hidden_size: int, moe: MoeConfig, *, router_name: str = "gate") -> None:
        super().__init__()
        router = TopKRouter(
            hidden_size,
            moe.num_experts,
            moe.num_experts_per_tok,
            moe.norm_topk_prob,
            bias=moe.router_bias,
            selection_bias=moe.selection_bias,
        )
        self.router_name = router_name
        self.add_module(router_name, router)
        self.experts = GroupedExperts(
            moe.num_experts, hidden_size, moe.moe_intermediate_size, bias=moe.expert_bias, activation=moe.activation
        )

    def forward(self, x_BSH: Tensor) -> Tensor:
        hidden_TH = x_BSH.reshape(-1, x_BSH.shape[-1])
        # Each row of the batch is one sequence: the unit of the router's capacity limit.
        router = getattr(self, self.router_name)
        topk_ids_TK, topk_weights_TK, _ = router(hidden_TH, sequence_length=x_BSH.shape[1])
        out_TH: Tensor = self.experts(hidden_TH, topk_ids_TK, topk_weights_TK)
        return out_TH.view_as(x_BSH)
