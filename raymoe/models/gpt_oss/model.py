"""gpt-oss (openai/gpt-oss-20b, openai/gpt-oss-120b).

Every layer: attention with biases, GQA, YaRN RoPE and learned sinks, sliding-window or full by
``layer_types``; then a sparse MoE (``mlp.router`` with a bias, softmax over the top-k logits;
experts with biases, interleaved gate/up features and the clamped SwiGLU). Experts are kept as
``gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]``; the hub holds them transposed
(``[E, H, 2I]`` / ``[E, I, H]``, bf16 checkpoints) or MXFP4-quantized in the ``[E, 2I, H]``
orientation (``*_blocks`` + ``*_scales``). Saving writes the transposed plain tensors.
"""

from __future__ import annotations

from collections.abc import Collection

from torch import nn

from raymoe.models.common.config import ModelConfig
from raymoe.models.common.decoder import CausalLM
from raymoe.models.common.hub_layout import HubKeys, HubLayout, Mxfp4, Transpose
from raymoe.models.common.plans import DefaultPlans
from raymoe.models.gpt_oss.plans import gpt_oss_plans
from raymoe.models.moe import SparseMoeBlock


class GptOssForCausalLM(CausalLM):
    model_type = "gpt_oss"

    def build_mlp(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        assert config.moe is not None  # parse_gpt_oss_config always sets it
        return SparseMoeBlock(config.hidden_size, config.moe, router_name="router")

    def default_plans(self) -> DefaultPlans:
        return gpt_oss_plans(self.config)

    def hub_layout(self, available: Collection[str] | None = None) -> HubLayout:
        layout = super().hub_layout(available)
        for i in range(self.config.num_hidden_layers):
            for weight in ("gate_up_proj", "down_proj"):
                name = f"model.layers.{i}.mlp.experts.{weight}"
                layout[name] = _expert_weight(name, available)
        return layout


def _expert_weight(name: str, available: Collection[str] | None) -> HubKeys:
    """MXFP4 parts when the checkpoint has them, else the transposed plain tensor."""
    blocks, scales = f"{name}_blocks", f"{name}_scales"
    if available is not None and blocks in available:
        return Mxfp4(blocks, scales)
    return Transpose(name)
