"""What a training step allocates on a rank beyond the weights and optimizer states it holds: an estimate from the
model's shapes and the layout, before anything is loaded (``raymoe.plan``).

Counted per rank, in bytes, for one micro-batch of ``rows`` sequences of ``seq_len`` tokens (``T = rows * seq_len /
cp_size`` tokens on the rank; a tp group shares its rows, each tp rank holding its share of heads and widths):

    saved        what autograd keeps from forward for backward, every decoder layer (``full`` activation
                 checkpointing: each layer's input only)
                   attention   norm input and output, q / k / v before and after their norms and RoPE (and
                               padded for sinks), the attention output             (heads / tp)
                   MoE         router logits and probabilities (fp32), the routed pairs' rows through the grouped
                               GEMMs: gathered input, gate_up output, activation, down output, weighted output
                                                                                   (T * top_k pairs:
                               masked EP runs every pair on every rank, dispatch about T * top_k received, TP splits
                               the expert width), shared experts as a dense MLP
                   dense MLP   gate_up output and activation                        (width / tp)
    head         the logits ``[T, vocab / tp]`` and the loss's float32 copy, log-softmax and logit gradient, with
                 the final norm's input and output: all live when backward begins
    recomputed   ``full`` checkpointing: the largest layer's activations, recomputed in backward, at their most
                 (backward has consumed a quarter of them, the feed-forward's output side, by then: measured)
    layer        what is left of the first layer's activations as backward ends and the last gradients appear:
                 about half of them (measured)
    transient    a materialized score matrix's two gradients (of the softmax and of the scores), which come after
                 the layer's feed-forward finished its backward and freed its activations
    gathered     FSDP2: the unsharded weights of two layers (one computing, one prefetched) in the compute dtype,
                 or of every layer where every unit keeps them until backward (``fsdp_reshard_after_forward``),
                 and in backward one layer's unsharded gradient before its reduce-scatter (reduce dtype)

A step's growth peaks in backward's first steps (every saved activation with the head, or with a recomputed
layer), or as it ends (every gradient and the last layer's activations):
``growth(gradients) = gathered + max(saved + max(head, recomputed + transient), gradients + layer + transient)``.
Approximate by design (element counts of the tensors the model code saves, not an allocator trace); checked
against the profiler's measured step growth on CPU at three sequence lengths (``tests/driver/test_plan.py``).
Gradients are not here: they are exact (:func:`raymoe.rank.footprint.planned_memory`).
"""

from __future__ import annotations

from dataclasses import dataclass

from raymoe.models.common.config import ModelConfig
from raymoe.spec.config import DistributedConfig

FLOAT32_BYTES = 4
INDEX_BYTES = 8  # int64
# Under full checkpointing a step peaks inside the recomputed layer's backward, once the feed-forward's output side
# (a quarter of the layer's activations) is consumed: measured on Qwen3-MoE, gpt-oss and DeepSeek-V3 (CPU, profiler)
RECOMPUTED_AT_PEAK = 0.75
# As backward ends, the first layer's weights get their gradients while its activations are consumed: about half of
# them are left when the last gradients exist (measured likewise)
LEFT_AT_THE_END = 0.5


@dataclass(frozen=True)
class StepActivations:
    """A step's estimated bytes beyond what a rank holds (module doc), gradients aside."""

    saved: int
    head: int
    recomputed: int  # 0 without checkpointing
    layer: int
    transient: int
    gathered: int

    def growth(self, gradients: int) -> int:
        """What the step allocates at its peak beyond the held weights and AdamW states, with ``gradients`` bytes
        of gradients (exact, from the plan)."""
        peak_early = self.saved + max(self.head, self.recomputed + self.transient)
        return self.gathered + max(peak_early, gradients + self.layer + self.transient)


@dataclass(frozen=True)
class _Widths:
    """Per-token element counts of one layer on one rank, by dtype, and what it holds per (query, key) pair."""

    compute: float  # attention and feed-forward tensors in the compute dtype
    feed_forward: float  # of which the feed-forward's (MLP, or the MoE block's experts and shared experts)
    fp32: float  # router logits and probabilities (float32)
    index: float  # the routing's int64 indices: top-k ids, sort order, its inverse, gathered rows' tokens
    layer_input: float  # the residual stream per token (what full checkpointing keeps)
    scores: float  # per (query, key): heads whose [S, L] scores are materialized (SDPA's math path), 0 if fused
    mask: bool  # an explicit [S, L] mask (sliding window, sinks): one compute-dtype value per (query, key)


def estimate_activations(
    config: ModelConfig,
    layout: DistributedConfig,
    *,
    seq_len: int,
    rows: int,
    compute_bytes: int,
    layer_gathered: int = 0,
    layer_gradients: int = 0,
    kept_gathered: int = 0,
    device: str = "cuda",
) -> StepActivations:
    """The estimate of the module doc for one rank of ``layout`` (resolved). ``layer_gathered`` /
    ``layer_gradients``: the bytes FSDP2 gathers of the largest decoder layer's weights and its unsharded gradients
    (:class:`raymoe.rank.footprint.PlannedRank`; 0 without FSDP2); ``kept_gathered``: every unit's gathered weights,
    where every unit keeps them from forward to backward (:mod:`raymoe.spec.reshard`; 0 where they are freed).
    ``device``: ``cuda`` (SDPA's fused kernels take every head shape) or ``cpu`` (its flash kernel needs one head dim
    for q, k and v: MLA's attention runs on the math path, which holds ``[S, L]`` scores per head)."""
    tp, cp = layout.tp_size or 1, layout.cp_size or 1
    queries = seq_len / cp
    tokens = rows * queries
    checkpointed = layout.activation_checkpointing == "full"
    layers = [_layer_widths(config, layout, index, device) for index in range(config.num_hidden_layers)]

    def layer_bytes(w: _Widths) -> float:
        per_token = w.compute * compute_bytes + w.fp32 * FLOAT32_BYTES + w.index * INDEX_BYTES
        pairs = (rows * w.scores + w.mask) * queries * seq_len * compute_bytes
        return tokens * per_token + pairs

    def backward_transient(w: _Widths) -> float:
        scores = 2 * rows * w.scores * queries * seq_len * compute_bytes
        return max(0.0, scores - tokens * w.feed_forward * compute_bytes)

    transient = max(backward_transient(w) for w in layers)
    largest = max(layer_bytes(w) for w in layers)
    if checkpointed:  # every layer's input, and one layer recomputed at a time
        saved = sum(tokens * w.layer_input * compute_bytes for w in layers)
        recomputed = RECOMPUTED_AT_PEAK * largest
    else:
        saved, recomputed = sum(layer_bytes(w) for w in layers), 0.0
    layer = largest * LEFT_AT_THE_END
    vocab = config.vocab_size / tp
    head = tokens * (
        vocab * compute_bytes + 3 * vocab * FLOAT32_BYTES + 2 * config.hidden_size * compute_bytes + 3 * INDEX_BYTES
    )  # logits, their float32 copy, log-softmax and gradient; the final norm; input ids, labels, targets
    gathered = (kept_gathered or 2 * layer_gathered) + layer_gradients
    return StepActivations(round(saved), round(head), round(recomputed), round(layer), round(transient), gathered)


def _layer_widths(config: ModelConfig, layout: DistributedConfig, layer: int, device: str) -> _Widths:
    tp = layout.tp_size or 1
    hidden = config.hidden_size
    residual = hidden / tp if layout.enable_sequence_parallel else hidden
    norms = 2 * (residual + hidden)  # two norms: input (the residual share) and output (what the projections read)
    attention = norms + _attention_width(config) / tp
    index = 0.0
    if config.layer_is_sparse(layer):
        feed_forward, fp32 = _moe_width(config, layout)
        assert config.moe is not None
        index = 5.0 * config.moe.num_experts_per_tok + 2
    else:
        feed_forward, fp32 = 3 * config.intermediate_size / tp, 0.0
    math_path = config.mla is not None and device == "cpu"
    scores = config.num_attention_heads / tp if math_path else 0.0
    masked = config.attention_sinks or config.attention_window(layer) is not None
    return _Widths(attention + feed_forward, feed_forward, fp32, index, residual, scores, masked)


def _attention_width(config: ModelConfig) -> float:
    """Per-token elements attention saves over all heads (before the tp split)."""
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    mla = config.mla
    if mla is not None:  # latent projections, then per-head q, k (nope + rope parts) and v
        latent = (mla.q_lora_rank or 0) * 2 + (mla.kv_lora_rank + mla.qk_rope_head_dim) * 2
        return latent + heads * (3 * mla.qk_head_dim + 2 * mla.v_head_dim)
    head_dim = config.head_dim
    copies = 4 if config.qk_norm else 3  # projected, (normed,) rotated, as SDPA keeps it (and o_proj's input)
    width = (heads + 2 * kv_heads) * head_dim * copies + heads * head_dim
    if config.attention_sinks:  # q, k and v padded by one sink channel to a multiple of 8, as SDPA keeps them
        padded = -(-(head_dim + 1) // 8) * 8
        width += (heads + 2 * kv_heads) * padded
    return width


def _moe_width(config: ModelConfig, layout: DistributedConfig) -> tuple[float, float]:
    """Per-token elements of an MoE block (compute dtype, float32) on one rank."""
    moe = config.moe
    assert moe is not None
    tp, ep = layout.tp_size or 1, layout.ep_size or 1
    hidden, top_k = config.hidden_size, moe.num_experts_per_tok
    # Without EP the experts split their width over tp; with EP each rank holds whole experts (masking runs every
    # pair on every rank, dispatch receives about top_k pairs per token of its group).
    width = moe.moe_intermediate_size / (tp if ep == 1 else 1)
    # a pair's row gathered, its gate_up output, activation and down output, and the weighted output; a clamped
    # SwiGLU (gpt-oss) keeps its clamped gate and up too; dispatch's send and receive rows
    activation = 5 if moe.activation.clamp_limit is not None else 3
    pairs = top_k * (3 * hidden + activation * width) + (2 * top_k * hidden if ep > 1 else 0)
    shared = 3 * moe.shared_expert_intermediate_size / tp
    router = 3 * moe.num_experts  # logits, probabilities, their normalised top-k copy
    return pairs + shared, float(router)
