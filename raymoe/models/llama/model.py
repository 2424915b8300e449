"""The Llama causal LM: the shared dense decoder, hub names as they are (no fused tensors)."""

from __future__ import annotations

from raymoe.models.common.dense import DenseCausalLM


class LlamaForCausalLM(DenseCausalLM):
    """Attention without q/k norms; default plans from :func:`raymoe.models.common.plans.dense_tp_plan`."""

    model_type = "llama"
