"""gpt-oss's default plans: TP over heads (sinks included) and expert features, EP by token dispatch.

transformers 5.23 ships only gpt-oss's ``base_model_ep_plan`` (the four expert tensors ``grouped_gemm``,
the experts ``ep_dispatch_experts``); raymoe adds a TP plan:

    q/k/v_proj colwise, o_proj rowwise        whole heads per rank
    self_attn.sinks colwise (Shard(0))        each rank keeps its heads' sinks;
    self_attn local_params                    the attention forward sees them as plain tensors
    experts.gate_up_proj(_bias) colwise       whole interleaved (gate, up) pairs per rank
    experts.down_proj rowwise                 its bias replicated: moe_tp_experts adds 1/tp per rank
    experts moe_tp_experts                    partial sums all-reduced
    lm_head colwise_gather_output

Masking instead of dispatch, as the seed shows it (``ep_size == tp_size``):
``ep_plan={"model.layers.*.mlp.router": "ep_router", "model.layers.*.mlp.experts": "moe_tp_experts"}``.
"""

from __future__ import annotations

from raymoe.models.common.config import ModelConfig
from raymoe.models.common.plans import ATTENTION_TP, LM_HEAD_TP, DefaultPlans, fsdp_plan

EXPERTS = "model.layers.*.mlp.experts"
GPT_OSS_ATTENTION_TP = {
    **ATTENTION_TP,
    "model.layers.*.self_attn.sinks": "colwise",
    "model.layers.*.self_attn": "local_params",
}
GPT_OSS_EXPERTS_TP = {
    f"{EXPERTS}.gate_up_proj": "colwise",
    f"{EXPERTS}.gate_up_proj_bias": "colwise",
    f"{EXPERTS}.down_proj": "rowwise",
    f"{EXPERTS}.down_proj_bias": "rowwise",
    EXPERTS: "moe_tp_experts",
}
GPT_OSS_EXPERTS_EP = {
    f"{EXPERTS}.gate_up_proj": "grouped_gemm",
    f"{EXPERTS}.gate_up_proj_bias": "grouped_gemm",
    f"{EXPERTS}.down_proj": "grouped_gemm",
    f"{EXPERTS}.down_proj_bias": "grouped_gemm",
    EXPERTS: "ep_dispatch_experts",
}


def gpt_oss_plans(config: ModelConfig) -> DefaultPlans:
    """Every gpt-oss layer is sparse, so the expert rules always match."""
    return DefaultPlans(
        tp={**GPT_OSS_ATTENTION_TP, **GPT_OSS_EXPERTS_TP, **LM_HEAD_TP},
        ep=GPT_OSS_EXPERTS_EP,
        fsdp=fsdp_plan(config.tie_word_embeddings),
    )
