"""A sparse MoE feed-forward: route each token, run its experts, sum their weighted outputs (+ shared experts)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from raymoe.models.common.config import ModelConfig, MoeConfig
from raymoe.models.common.mlp import FeedForward
from raymoe.models.moe.experts import GroupedExperts
from raymoe.models.moe.router import TopKRouter


class SparseMoeBlock(nn.Module):
    """``x [B, S, H]`` -> ``[B, S, H]``: a router and ``experts``, plus shared experts when the config has them.

    The router's attribute is the hub's module name: ``gate`` (``mlp.gate``: Qwen3-MoE, Mixtral, DeepSeek-V3)
    or ``router`` (``mlp.router``: gpt-oss); ``router_name`` picks it. Shared experts (``MoeConfig.
    shared_expert_intermediate_size > 0``) are one dense SwiGLU every token runs, added to the routed sum;
    ``shared_name`` is their hub name (``shared_experts``: DeepSeek-V3, GLM-4.5; ``shared_expert``:
    Qwen2-MoE, whose output is also scaled by ``sigmoid(shared_expert_gate(x))``).
    """

    def __init__(
        self, hidden_size: int, moe: MoeConfig, *, router_name: str = "gate", shared_name: str = "shared_experts"
    ) -> None:
        super().__init__()
        router = TopKRouter(
            hidden_size,
            moe.num_experts,
            moe.num_experts_per_tok,
            moe.norm_topk_prob,
            bias=moe.router_bias,
            selection_bias=moe.selection_bias,
            scoring=moe.scoring,
            n_group=moe.n_group,
            topk_group=moe.topk_group,
            scaling=moe.routed_scaling_factor,
        )
        self.router_name = router_name
        self.add_module(router_name, router)
        self.experts = GroupedExperts(
            moe.num_experts, hidden_size, moe.moe_intermediate_size, bias=moe.expert_bias, activation=moe.activation
        )
        self.shared_name: str | None = None
        if moe.shared_expert_intermediate_size:
            self.shared_name = shared_name
            self.add_module(shared_name, FeedForward(hidden_size, moe.shared_expert_intermediate_size))
        self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False) if moe.shared_expert_gate else None

    def forward(self, x_BSH: Tensor, routes_BSK: Tensor | None = None) -> Tensor:
        """``routes [B, S, K]`` (global expert ids): replayed routes the router uses instead of its own choice."""
        hidden_TH = x_BSH.reshape(-1, x_BSH.shape[-1])
        # Each row of the batch is one sequence: the unit of the router's capacity limit.
        router = getattr(self, self.router_name)
        forced_TK = routes_BSK.reshape(hidden_TH.shape[0], -1) if routes_BSK is not None else None
        topk_ids_TK, topk_weights_TK, _ = router(hidden_TH, sequence_length=x_BSH.shape[1], forced_TK=forced_TK)
        out_TH: Tensor = self.experts(hidden_TH, topk_ids_TK, topk_weights_TK)
        if self.shared_name is not None:
            shared_TH = getattr(self, self.shared_name)(hidden_TH)
            if self.shared_expert_gate is not None:
                shared_TH = torch.sigmoid(self.shared_expert_gate(hidden_TH)) * shared_TH
            out_TH = out_TH + shared_TH
        return out_TH.view_as(x_BSH)


def sparse_or_dense_mlp(config: ModelConfig, layer_idx: int, **block_options: str) -> nn.Module:
    """Layer ``layer_idx``'s MLP: a :class:`SparseMoeBlock` (``block_options`` passed on) where the config makes the
    layer sparse (``decoder_sparse_step``, ``mlp_only_layers``, ``first_k_dense_replace``), else the dense one."""
    if config.layer_is_sparse(layer_idx):
        assert config.moe is not None  # layer_is_sparse implies it
        return SparseMoeBlock(config.hidden_size, config.moe, **block_options)
    return FeedForward(config.hidden_size, config.intermediate_size)
