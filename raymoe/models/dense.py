"""Dense decoders: Llama and Qwen3 (Qwen3 adds per-head q/k RMSNorm). Every layer has a SwiGLU MLP."""

from __future__ import annotations

from torch import nn

from raymoe.models.config import ModelConfig
from raymoe.models.decoder import CausalLM
from raymoe.models.default_plans import ATTENTION_TP, DENSE_MLP_TP, LM_HEAD_TP, QK_NORM_TP, fsdp_plan
from raymoe.models.mlp import FeedForward
from raymoe.plans import DefaultPlans


class DenseCausalLM(CausalLM):
    """The shared dense family; subclasses only name their ``model_type``."""

    def build_mlp(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        return FeedForward(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)

    def default_plans(self) -> DefaultPlans:
        qk_norm = QK_NORM_TP if self.config.qk_norm else {}
        tp = {**ATTENTION_TP, **qk_norm, **DENSE_MLP_TP, **LM_HEAD_TP}
        return DefaultPlans(tp=tp, ep={}, fsdp=fsdp_plan(self.config.tie_word_embeddings))


class LlamaForCausalLM(DenseCausalLM):
    model_type = "llama"


class Qwen3ForCausalLM(DenseCausalLM):
    model_type = "qwen3"
