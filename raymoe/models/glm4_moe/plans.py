"""GLM-4.5's default plans: transformers 5.23's TP plan (heads, expert features, shared experts and dense MLPs
split like dense MLPs; q/k norms replicated), EP by token dispatch. The router and its correction bias stay whole.
Masking instead: ``ep_size == tp_size`` and ``ep_plan={"model.layers.*.mlp.gate": "ep_router",
"model.layers.*.mlp.experts": "moe_tp_experts"}``."""

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
    shared_experts_tp,
)


def glm4_moe_plans(config: ModelConfig, sparse_layers: list[int]) -> DefaultPlans:
    """Expert rules only when some layer is sparse, dense-MLP rules only when some layer is dense."""
    has_sparse = bool(sparse_layers)
    has_dense = len(sparse_layers) < config.num_hidden_layers
    tp = {
        **ATTENTION_TP,
        **(QK_NORM_TP if config.qk_norm else {}),
        **({**EXPERTS_TP, **shared_experts_tp("shared_experts")} if has_sparse else {}),
        **(DENSE_MLP_TP if has_dense else {}),
        **LM_HEAD_TP,
    }
    return DefaultPlans(tp=tp, ep=EXPERTS_EP if has_sparse else {}, fsdp=fsdp_plan(config.tie_word_embeddings))
