"""Qwen3-MoE's default plans: TP everywhere (experts by their intermediate dim), EP by token dispatch.

Token dispatch is the family's EP default (SPEC EP-7). Masking instead: ``ep_size == tp_size`` and
``ep_plan={"model.layers.*.mlp.gate": "ep_router", "model.layers.*.mlp.experts": "moe_tp_experts"}``.
"""

from __future__ import annotations

from raymoe.models.common.config import ModelConfig
from raymoe.models.common.plans import (
    ATTENTION_TP,
    DENSE_MLP_TP,
    EXPERTS_EP,
    EXPERTS_TP,
    LM_HEAD_TP,
    QK_NORM_TP,
    DefaultPlans,
    fsdp_plan,
)


def qwen3_moe_plans(config: ModelConfig, sparse_layers: list[int]) -> DefaultPlans:
    """Expert rules only when some layer is sparse, dense-MLP rules only when some layer is dense."""
    has_sparse = bool(sparse_layers)
    has_dense = len(sparse_layers) < config.num_hidden_layers
    tp = {
        **ATTENTION_TP,
        **QK_NORM_TP,
        **(EXPERTS_TP if has_sparse else {}),
        **(DENSE_MLP_TP if has_dense else {}),
        **LM_HEAD_TP,
    }
    ep = EXPERTS_EP if has_sparse else {}
    return DefaultPlans(tp=tp, ep=ep, fsdp=fsdp_plan(config.tie_word_embeddings))
