"""Qwen3-MoE (the architecture of Qwen/Qwen3-30B-A3B).

Qwen3 attention (GQA, q/k RMSNorm, RoPE) with a sparse MoE feed-forward in every layer that
``MoeConfig.is_sparse`` selects (``decoder_sparse_step``, minus ``mlp_only_layers``) and a dense
SwiGLU MLP of ``intermediate_size`` in the others. Experts are fused in memory
(``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``) and per-expert in the hub checkpoint.
"""

from __future__ import annotations

from collections.abc import Collection

from torch import nn

from raymoe.models.common.config import ModelConfig, MoeConfig
from raymoe.models.common.decoder import CausalLM
from raymoe.models.common.hub_layout import HubLayout, per_expert_layout
from raymoe.models.common.plans import DefaultPlans
from raymoe.models.moe.block import sparse_or_dense_mlp
from raymoe.models.qwen3_moe.plans import qwen3_moe_plans


class Qwen3MoeForCausalLM(CausalLM):
    model_type = "qwen3_moe"

    @property
    def moe(self) -> MoeConfig:
        assert self.config.moe is not None  # parse_model_config always sets it for qwen3_moe
        return self.config.moe

    def build_mlp(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        return sparse_or_dense_mlp(config, layer_idx)

    def default_plans(self) -> DefaultPlans:
        return qwen3_moe_plans(self.config, self.sparse_layers())

    def hub_layout(self, available: Collection[str] | None = None) -> HubLayout:
        layout = super().hub_layout(available)
        for i in self.sparse_layers():
            layout.update(per_expert_layout(f"model.layers.{i}.mlp.experts", self.moe.num_experts))
        return layout
