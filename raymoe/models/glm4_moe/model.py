"""GLM-4.5 / GLM-4.6 (the architecture of zai-org/GLM-4.5).

Attention: GQA, q/k/v biases (``attention_bias``, none on o_proj), optional q/k RMSNorm, RoPE on the first
``rotary_dim`` channels of each head. The first ``first_k_dense_replace`` layers have a dense SwiGLU of
``intermediate_size``; the others a sigmoid-scored router ``mlp.gate`` with ``e_score_correction_bias``
(selection only) and group-limited top-k, routed experts (per-expert in the hub, fused in memory) and
shared experts ``mlp.shared_experts`` added to the routed sum.
"""

from __future__ import annotations

from collections.abc import Collection

from torch import nn

from raymoe.models.common.config import ModelConfig
from raymoe.models.common.decoder import CausalLM
from raymoe.models.common.hub_layout import HubLayout, is_extra_layer_key, per_expert_layout
from raymoe.models.common.plans import DefaultPlans
from raymoe.models.glm4_moe.plans import glm4_moe_plans
from raymoe.models.moe.block import sparse_or_dense_mlp


class Glm4MoeForCausalLM(CausalLM):
    model_type = "glm4_moe"

    def build_mlp(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        return sparse_or_dense_mlp(config, layer_idx)

    def default_plans(self) -> DefaultPlans:
        return glm4_moe_plans(self.config, self.sparse_layers())

    def hub_layout(self, available: Collection[str] | None = None) -> HubLayout:
        layout = super().hub_layout(available)
        assert self.config.moe is not None  # parse_glm4_moe_config always sets it
        for i in self.sparse_layers():
            layout.update(per_expert_layout(f"model.layers.{i}.mlp.experts", self.config.moe.num_experts))
        return layout

    def is_ignored_hub_key(self, key: str) -> bool:
        return super().is_ignored_hub_key(key) or is_extra_layer_key(key, self.config.num_hidden_layers)
