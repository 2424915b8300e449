"""DeepSeek-V3's default plans: MLA split by heads, experts by features (TP) or by token dispatch (EP).

transformers 5.23 ships no DeepSeek-V3 TP plan; raymoe's keeps each head's channels on one rank::

    q_proj / q_b_proj colwise           whole heads (nope + rope channels); q_a_proj and q_a_layernorm whole
    kv_a_proj_with_mqa mla_kv_a_proj    whole on every rank; the shared RoPE key's gradient all-reduced
    kv_a_layernorm                      whole (its input gradient comes back whole through kv_b_proj)
    kv_b_proj colwise                   whole heads (nope key + value channels)
    o_proj rowwise                      whole heads (value channels)
    experts, shared experts, dense MLPs as GLM-4.5 / Qwen3-MoE; lm_head colwise_gather_output

Masking instead of dispatch: ``ep_size == tp_size`` and ``ep_plan={"model.layers.*.mlp.gate": "ep_router",
"model.layers.*.mlp.experts": "moe_tp_experts"}``.
"""

from __future__ import annotations

from raymoe.models.common.config import ModelConfig
from raymoe.models.common.plans import (
    DENSE_MLP_TP,
    EXPERTS_EP,
    EXPERTS_TP,
    LM_HEAD_TP,
    DefaultPlans,
    fsdp_plan,
    shared_experts_tp,
)

ATTENTION = "model.layers.*.self_attn"


def mla_tp_plan(config: ModelConfig) -> dict[str, str]:
    """Heads split over tp; the low-rank down projections and their norms whole."""
    assert config.mla is not None
    query = (
        {f"{ATTENTION}.q_proj": "colwise"} if config.mla.q_lora_rank is None else {f"{ATTENTION}.q_b_proj": "colwise"}
    )
    return {
        **query,
        f"{ATTENTION}.kv_a_proj_with_mqa": "mla_kv_a_proj",
        f"{ATTENTION}.kv_b_proj": "colwise",
        f"{ATTENTION}.o_proj": "rowwise",
    }


def deepseek_v3_plans(config: ModelConfig, sparse_layers: list[int]) -> DefaultPlans:
    """Expert rules only when some layer is sparse, dense-MLP rules only when some layer is dense."""
    has_sparse = bool(sparse_layers)
    has_dense = len(sparse_layers) < config.num_hidden_layers
    tp = {
        **mla_tp_plan(config),
        **({**EXPERTS_TP, **shared_experts_tp("shared_experts")} if has_sparse else {}),
        **(DENSE_MLP_TP if has_dense else {}),
        **LM_HEAD_TP,
    }
    return DefaultPlans(tp=tp, ep=EXPERTS_EP if has_sparse else {}, fsdp=fsdp_plan(config.tie_word_embeddings))
