"""Mixtral's default plans, transformers 5.23's ``base_model_tp_plan`` / ``base_model_ep_plan``: TP over heads
and expert features, EP by token dispatch (masking: ``ep_plan={"model.layers.*.mlp.gate": "ep_router",
"model.layers.*.mlp.experts": "moe_tp_experts"}`` with ``ep_size == tp_size``)."""

from __future__ import annotations

from raymoe.models.common.config import ModelConfig
from raymoe.models.common.plans import ATTENTION_TP, EXPERTS_EP, EXPERTS_TP, LM_HEAD_TP, DefaultPlans, fsdp_plan


def mixtral_plans(config: ModelConfig) -> DefaultPlans:
    """Every Mixtral layer is sparse."""
    return DefaultPlans(
        tp={**ATTENTION_TP, **EXPERTS_TP, **LM_HEAD_TP}, ep=EXPERTS_EP, fsdp=fsdp_plan(config.tie_word_embeddings)
    )
