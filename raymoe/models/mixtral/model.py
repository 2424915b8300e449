"""Mixtral (mistralai/Mixtral-8x7B, 8x22B).

Llama attention (GQA, RoPE, optionally a sliding window on every layer) and a sparse MoE in every
layer: router ``mlp.gate`` (softmax, top-k, renormalised), SwiGLU experts of ``intermediate_size``
fused in memory as ``gate_up_proj [E, 2I, H]`` (gate rows, then up rows) and ``down_proj [E, H, I]``.

Hub checkpoints come in two layouts, both read; raymoe writes the first, as transformers 5.23 does::

    per expert (original)   model.layers.{i}.block_sparse_moe.gate.weight
                            model.layers.{i}.block_sparse_moe.experts.{e}.w1 / w3 / w2.weight  (gate / up / down)
    fused                   model.layers.{i}.mlp.gate.weight
                            model.layers.{i}.mlp.experts.gate_up_proj [E, 2I, H], .down_proj [E, H, I]
"""

from __future__ import annotations

from collections.abc import Collection

from torch import nn

from raymoe.models.common.config import ModelConfig
from raymoe.models.common.decoder import CausalLM
from raymoe.models.common.hub_layout import Concat, HubLayout, Stack
from raymoe.models.common.plans import DefaultPlans
from raymoe.models.mixtral.plans import mixtral_plans
from raymoe.models.moe import SparseMoeBlock


class MixtralForCausalLM(CausalLM):
    model_type = "mixtral"

    def build_mlp(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        assert config.moe is not None  # parse_mixtral_config always sets it
        return SparseMoeBlock(config.hidden_size, config.moe)

    def default_plans(self) -> DefaultPlans:
        return mixtral_plans(self.config)

    def hub_layout(self, available: Collection[str] | None = None) -> HubLayout:
        layout = super().hub_layout(available)
        if available is not None and "model.layers.0.block_sparse_moe.gate.weight" not in available:
            return layout  # the fused layout: hub names are the parameter names
        assert self.config.moe is not None
        experts = range(self.config.moe.num_experts)
        for i in range(self.config.num_hidden_layers):
            old, new = f"model.layers.{i}.block_sparse_moe", f"model.layers.{i}.mlp"
            layout[f"{new}.gate.weight"] = f"{old}.gate.weight"
            layout[f"{new}.experts.gate_up_proj"] = Stack(
                tuple(Concat((f"{old}.experts.{e}.w1.weight", f"{old}.experts.{e}.w3.weight")) for e in experts)
            )
            layout[f"{new}.experts.down_proj"] = Stack(tuple(f"{old}.experts.{e}.w2.weight" for e in experts))
        return layout
