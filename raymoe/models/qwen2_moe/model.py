"""Qwen2-MoE (the architecture of Qwen/Qwen1.5-MoE-A2.7B and Qwen2-57B-A14B).

Attention: GQA with RoPE and biases on q/k/v (``qkv_bias``), none on o_proj. Feed-forward: in every
layer ``MoeConfig.is_sparse`` selects (``decoder_sparse_step``, minus ``mlp_only_layers``) a softmax
top-k router ``mlp.gate``, routed experts and one shared expert ``mlp.shared_expert`` whose output is
scaled by ``sigmoid(mlp.shared_expert_gate(x))`` and added; elsewhere a dense SwiGLU of
``intermediate_size``. Experts are fused in memory and per-expert in the hub checkpoint.
"""

from __future__ import annotations

from collections.abc import Collection

from torch import nn

from raymoe.models.common.config import ModelConfig
from raymoe.models.common.decoder import CausalLM
from raymoe.models.common.hub_layout import HubLayout, per_expert_layout
from raymoe.models.common.plans import DefaultPlans
from raymoe.models.moe.block import sparse_or_dense_mlp
from raymoe.models.qwen2_moe.plans import qwen2_moe_plans

SHARED_EXPERT = "shared_expert"


class Qwen2MoeForCausalLM(CausalLM):
    model_type = "qwen2_moe"

    def build_mlp(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        return sparse_or_dense_mlp(config, layer_idx, shared_name=SHARED_EXPERT)

    def default_plans(self) -> DefaultPlans:
        return qwen2_moe_plans(self.config, self.sparse_layers())

    def hub_layout(self, available: Collection[str] | None = None) -> HubLayout:
        layout = super().hub_layout(available)
        assert self.config.moe is not None  # parse_qwen2_moe_config always sets it
        for i in self.sparse_layers():
            layout.update(per_expert_layout(f"model.layers.{i}.mlp.experts", self.config.moe.num_experts))
        return layout
