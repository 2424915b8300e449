"""The dense decoder shared by Llama and Qwen3: every layer has a SwiGLU MLP."""

from __future__ import annotations

from torch import nn

from raymoe.models.common.config import ModelConfig
from raymoe.models.common.decoder import CausalLM
from raymoe.models.common.mlp import FeedForward
from raymoe.models.common.plans import DefaultPlans, dense_tp_plan, fsdp_plan


class DenseCausalLM(CausalLM):
    """A decoder whose layers all have a dense MLP; a family subclass names its ``model_type``."""

    def build_mlp(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        return FeedForward(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)

    def default_plans(self) -> DefaultPlans:
        return DefaultPlans(tp=dense_tp_plan(self.config.qk_norm), fsdp=fsdp_plan(self.config.tie_word_embeddings))
