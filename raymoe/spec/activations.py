"""What a training step allocates on a rank beyond the weights and optimizer states it holds: an estimate from the
model's shapes and the layout, before anything is loaded (``raymoe.plan``).

Counted per rank, in bytes, for one micro-batch of ``rows`` sequences of ``seq_len`` tokens (``T = rows * seq_len /
cp_size`` tokens on the rank; a tp group shares its rows, each tp rank holding its share of heads and widths):

    saved        what autograd keeps from forward for backward, every decoder layer (``full`` activation
                 checkpointing: each layer's input only, and one layer's recomputed activations in backward)
                   attention   norm input and output, q / k / v before and after their norms and RoPE, the
                               attention output and its log-sum-exp                (heads / tp)
                   MoE         router logits and probabilities (fp32), the routed pairs' rows through the grouped
                               GEMMs: gathered input, gate_up output, activation, down output   (T * top_k pairs:
                               masked EP runs every pair on every rank, dispatch about T * top_k received, TP splits
                               the expert width), shared experts as a dense MLP
                   dense MLP   gate_up output and activation                        (width / tp)
    head         the logits ``[T, vocab / tp]`` and the loss's float32 copy, log-softmax and logit gradient, with
                 the final norm's input and output: all live when backward begins
    layer        backward's transients in one layer (the gradients flowing through it, about its saved activations)
    gathered     FSDP2: the unsharded weights of two layers (one computing, one prefetched) in the compute dtype,
                 and in backward one layer's unsharded gradient before its reduce-scatter (reduce dtype)

A step's growth peaks either as backward begins (every saved activation and the head) or as it ends (every
gradient and the last layer's transients): ``growth(gradients) = gathered + max(saved + head, gradients + layer)``.
Approximate by design (element counts of the tensors the model code saves, not an allocator trace); checked
against the profiler's measured step growth on CPU at three sequence lengths (``tests/driver/test_plan.py``).
Gradients are not here: they are exact (:func:`raymoe.rank.footprint.planned_memory`).
"""

from __future__ import annotations

from dataclasses import dataclass

from raymoe.models.common.config import ModelConfig
from raymoe.spec.config import DistributedConfig

FLOAT32_BYTES = 4


@dataclass(frozen=True)
class StepActivations:
    """A step's estimated bytes beyond what a rank holds (module doc), gradients aside."""

    saved: int
    head: int
    layer: int
    gathered: int

    def growth(self, gradients: int) -> int:
        """What the step allocates at its peak beyond the held weights and AdamW states, with ``gradients`` bytes
        of gradients (exact, from the plan)."""
        return self.gathered + max(self.saved + self.head, gradients + self.layer)


@dataclass(frozen=True)
class _Widths:
    """Per-token element counts of one layer on one rank."""

    attention: float  # everything attention saves per token
    feed_forward: float  # everything the MLP / MoE block saves per token (compute dtype)
    feed_forward_fp32: float  # router logits and probabilities per token (float32)
    layer_input: float  # the residual stream per token (what full checkpointing keeps)


def estimate_activations(
    config: ModelConfig,
    layout: DistributedConfig,
    *,
    seq_len: int,
    rows: int,
    compute_bytes: int,
    reduce_bytes: int,
    layer_param_elements: int,
    fsdp_wrapped: bool,
) -> StepActivations:
    """The estimate of the module doc for one rank of ``layout`` (resolved). ``layer_param_elements``: the largest
    decoder layer's parameter elements on this rank before FSDP2 shards them (after TP / EP), what FSDP2 gathers;
    ``fsdp_wrapped``: whether FSDP2 wraps the layers (and so gathers them)."""
    tp, cp = layout.tp_size or 1, layout.cp_size or 1
    tokens = rows * seq_len / cp
    checkpointed = layout.activation_checkpointing == "full"
    layers = [_layer_widths(config, layout, index) for index in range(config.num_hidden_layers)]

    def layer_bytes(w: _Widths) -> float:
        return tokens * ((w.attention + w.feed_forward) * compute_bytes + w.feed_forward_fp32 * FLOAT32_BYTES)

    largest = max(layer_bytes(w) for w in layers)
    if checkpointed:
        saved = sum(tokens * w.layer_input * compute_bytes for w in layers) + largest
    else:
        saved = sum(layer_bytes(w) for w in layers)
    vocab = config.vocab_size / tp
    head = tokens * (vocab * compute_bytes + 3 * vocab * FLOAT32_BYTES + 2 * config.hidden_size * compute_bytes)
    gathered = layer_param_elements * (2 * compute_bytes + reduce_bytes) if fsdp_wrapped else 0
    return StepActivations(saved=round(saved), head=round(head), layer=round(largest), gathered=gathered)


def _layer_widths(config: ModelConfig, layout: DistributedConfig, index: int) -> _Widths:
    tp = layout.tp_size or 1
    hidden = config.hidden_size
    residual = hidden / tp if layout.enable_sequence_parallel else hidden
    norms = 2 * (residual + hidden)  # two norms: input (the residual share) and output (what the projections read)
    attention = norms + _attention_width(config) / tp
    if config.layer_is_sparse(index):
        feed_forward, fp32 = _moe_width(config, layout)
    else:
        feed_forward, fp32 = 3 * config.intermediate_size / tp, 0.0
    return _Widths(attention, feed_forward, fp32, residual)


def _attention_width(config: ModelConfig) -> float:
    """Per-token elements attention saves over all heads (before the tp split)."""
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    mla = config.mla
    if mla is not None:  # latent projections, then per-head q, k (nope + rope parts) and v
        latent = (mla.q_lora_rank or 0) * 2 + (mla.kv_lora_rank + mla.qk_rope_head_dim) * 2
        return latent + heads * (3 * mla.qk_head_dim + 2 * mla.v_head_dim)
    head_dim = config.head_dim
    steps = 3 if config.qk_norm else 2  # projected, (normed,) rotated
    return heads * head_dim * (steps + 1) + kv_heads * head_dim * (steps + 1)


def _moe_width(config: ModelConfig, layout: DistributedConfig) -> tuple[float, float]:
    """Per-token elements of an MoE block (compute dtype, float32) on one rank."""
    moe = config.moe
    assert moe is not None
    tp, ep = layout.tp_size or 1, layout.ep_size or 1
    hidden, top_k = config.hidden_size, moe.num_experts_per_tok
    # Without EP the experts split their width over tp; with EP each rank holds whole experts (masking runs every
    # pair on every rank, dispatch receives about top_k pairs per token of its group).
    width = moe.moe_intermediate_size / (tp if ep == 1 else 1)
    pairs = top_k * (2 * hidden + 3 * width) + (2 * top_k * hidden if ep > 1 else 0)  # dispatch's send/receive rows
    shared = 3 * moe.shared_expert_intermediate_size / tp
    router = 3 * moe.num_experts  # logits, probabilities, their normalised top-k copy
    return pairs + shared, float(router)
