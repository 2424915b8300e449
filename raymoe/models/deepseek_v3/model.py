"""DeepSeek-V3 (deepseek-ai/DeepSeek-V3, DeepSeek-R1; the architecture of Kimi-K2 and Moonlight).

Every layer: multi-head latent attention (:mod:`raymoe.models.deepseek_v3.mla`), then a dense SwiGLU of
``intermediate_size`` in the first ``first_k_dense_replace`` layers and, in the others, a sigmoid-scored
router ``mlp.gate`` with ``e_score_correction_bias`` (selection only; bias balancing moves it) and
group-limited top-k, routed experts (per-expert in the hub, fused in memory) and shared experts
``mlp.shared_experts`` added to the routed sum. Hub checkpoints are plain or block-scaled FP8
(``X.weight`` float8_e4m3fn + ``X.weight_scale_inv``), each rank dequantizing its own slice while reading;
saving writes plain tensors. The multi-token-prediction layers of hub checkpoints are not loaded.
"""

from __future__ import annotations

from collections.abc import Collection

from torch import nn

from raymoe.models.common.config import ModelConfig
from raymoe.models.common.decoder import CausalLM
from raymoe.models.common.hub_layout import HubLayout, fp8_block_layout, is_extra_layer_key, per_expert_layout
from raymoe.models.common.plans import DefaultPlans
from raymoe.models.deepseek_v3.config import fp8_block_size
from raymoe.models.deepseek_v3.mla import MultiHeadLatentAttention
from raymoe.models.deepseek_v3.plans import deepseek_v3_plans
from raymoe.models.moe.block import sparse_or_dense_mlp


class DeepseekV3ForCausalLM(CausalLM):
    model_type = "deepseek_v3"

    def build_attention(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        return MultiHeadLatentAttention(config, layer_idx)

    def build_mlp(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        return sparse_or_dense_mlp(config, layer_idx)

    def default_plans(self) -> DefaultPlans:
        return deepseek_v3_plans(self.config, self.sparse_layers())

    def hub_layout(self, available: Collection[str] | None = None) -> HubLayout:
        layout = super().hub_layout(available)
        assert self.config.moe is not None  # parse_deepseek_v3_config always sets it
        for i in self.sparse_layers():
            layout.update(per_expert_layout(f"model.layers.{i}.mlp.experts", self.config.moe.num_experts))
        block = fp8_block_size(self.config.raw)
        if available is not None and block is not None:
            layout = fp8_block_layout(layout, available, block)
        return layout

    def is_ignored_hub_key(self, key: str) -> bool:
        return super().is_ignored_hub_key(key) or is_extra_layer_key(key, self.config.num_hidden_layers)
