"""A model's own parallel plans (:class:`DefaultPlans`) and the plan pieces the families share.

Plans are plain data: module or parameter paths (``*`` for a layer index) mapped to style names
(TP / EP) or FSDP strategies. The model only names styles; what a name means is the parallel
layer's business (:mod:`raymoe.parallel.styles`), and :mod:`raymoe.spec.plans` merges these
defaults with the user's overrides.

Contents follow transformers 5.23's ``base_model_tp_plan`` / ``base_model_ep_plan`` / FSDP plans
for Llama, Qwen3 and Qwen3-MoE, with the ``model.`` prefix written out. A family includes only
the pieces its modules have, so every default key matches something (a dense-MLP rule on a
model whose layers are all sparse would be a rule that matches nothing).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class DefaultPlans:
    """A model's own plans: ``base_model_tp_plan``, ``base_model_ep_plan`` and its FSDP plan."""

    tp: Mapping[str, str] = field(default_factory=dict)
    ep: Mapping[str, str] = field(default_factory=dict)
    fsdp: Mapping[str, str] = field(default_factory=dict)


ATTENTION_TP = {
    "model.layers.*.self_attn.q_proj": "colwise",
    "model.layers.*.self_attn.k_proj": "colwise",
    "model.layers.*.self_attn.v_proj": "colwise",
    "model.layers.*.self_attn.o_proj": "rowwise",
}
# q_norm/k_norm sit between a colwise and a rowwise layer: replicated, gradient all-reduced.
QK_NORM_TP = {
    "model.layers.*.self_attn.q_norm": "replicated_with_grad_allreduce",
    "model.layers.*.self_attn.k_norm": "replicated_with_grad_allreduce",
}
DENSE_MLP_TP = {
    "model.layers.*.mlp.gate_proj": "colwise",
    "model.layers.*.mlp.up_proj": "colwise",
    "model.layers.*.mlp.down_proj": "rowwise",
}
EXPERTS_TP = {
    "model.layers.*.mlp.experts.gate_up_proj": "packed_colwise",
    "model.layers.*.mlp.experts.down_proj": "rowwise",
    "model.layers.*.mlp.experts": "moe_tp_experts",
}
# Token dispatch is the default for Qwen3-MoE (SPEC EP-7).
EXPERTS_EP = {
    "model.layers.*.mlp.experts.gate_up_proj": "grouped_gemm",
    "model.layers.*.mlp.experts.down_proj": "grouped_gemm",
    "model.layers.*.mlp.experts": "ep_dispatch_experts",
}
LM_HEAD_TP = {"lm_head": "colwise_gather_output"}
# Sequence parallelism (enable_sequence_parallel): the norms run on a share of the sequence, so their weights'
# gradients are summed over the tp group. Every family's decoder has these norms.
SEQUENCE_PARALLEL_TP = {
    "model.layers.*.input_layernorm": "sequence_parallel",
    "model.layers.*.post_attention_layernorm": "sequence_parallel",
    "model.norm": "sequence_parallel",
}


def shared_experts_tp(name: str) -> dict[str, str]:
    """The shared experts' dense SwiGLU at ``model.layers.*.mlp.{name}``, split like a dense MLP (a gate on
    them, Qwen2-MoE's ``shared_expert_gate [1, H]``, stays whole: its input and output are replicated)."""
    prefix = f"model.layers.*.mlp.{name}"
    return {f"{prefix}.gate_proj": "colwise", f"{prefix}.up_proj": "colwise", f"{prefix}.down_proj": "rowwise"}


def fsdp_plan(tied_embeddings: bool) -> dict[str, str]:
    """Embedding and layers re-gathered for backward; final norm and head kept gathered.

    With tied embeddings the head's weight *is* the embedding's, so it must be wrapped once:
    the embedding keeps its gathered weight through forward (the head uses it last) and the
    head gets no rule of its own.
    """
    plan = {
        "model.embed_tokens": "free_full_weight",
        "model.layers.*": "free_full_weight",
        "model.norm": "keep_full_weight",
    }
    if tied_embeddings:
        plan["model.embed_tokens"] = "keep_full_weight"
    else:
        plan["lm_head"] = "keep_full_weight"
    return plan


def dense_tp_plan(qk_norm: bool) -> dict[str, str]:
    """Attention (with its q/k norms when the model has them), a dense SwiGLU MLP and the head."""
    return {**ATTENTION_TP, **(QK_NORM_TP if qk_norm else {}), **DENSE_MLP_TP, **LM_HEAD_TP}
