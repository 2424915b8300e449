"""The model architecture read from a Hugging Face ``config.json``: the fields every family shares.

Only the fields raymoe's model definitions use are read; the whole dict is kept as ``raw`` so
saving writes back exactly what was loaded. Every problem is a ``ValueError`` that names the
field: a missing or invalid required field is named with its value, and a config asking for a
feature raymoe does not implement (sliding windows, a RoPE scaling kind, attention dropout, ...)
says so instead of being ignored.

A family (one folder under ``raymoe/models/``) calls :func:`parse_decoder_config` with its
:class:`ConfigDefaults`: the defaults ``transformers`` uses for that model type where a hub
``config.json`` leaves a field out, so it builds the same architecture. The ``model_type`` ->
family table is :mod:`raymoe.models.registry`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from raymoe.models.common.activation import SWIGLU, GatedActivation

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
SLIDING_ATTENTION, FULL_ATTENTION = "sliding_attention", "full_attention"


@dataclass(frozen=True)
class ConfigDefaults:
    """What one family assumes where its ``config.json`` is silent, and which optional parts it has.

    ``head_dim`` None means ``hidden_size // num_attention_heads``. ``has_mlp_bias`` says whether the
    family reads ``mlp_bias`` (Llama) or never has MLP biases; ``has_moe`` whether it reads the
    routed-experts fields; ``router_selection_bias`` whether its routers carry a per-expert selection
    bias (``e_score_correction_bias``, DeepSeek-V3's auxiliary-loss-free balancing).
    """

    max_position_embeddings: int
    head_dim: int | None = None
    qk_norm: bool = False
    has_mlp_bias: bool = False
    has_moe: bool = False
    router_selection_bias: bool = False
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False
    # Which config field sizes the routed experts, and whether the family always renormalises the
    # top-k weights (Mixtral, gpt-oss: True) or reads norm_topk_prob (None).
    expert_size_field: str = "moe_intermediate_size"
    norm_topk_prob: bool | None = None
    # Sliding-window attention: "none" (the family has none; a sliding window it cannot honour is
    # refused), "all" (Mixtral: sliding_window, when set, applies to every layer) or "layer_types"
    # (gpt-oss: each layer's layer_types entry picks sliding or full attention).
    sliding_window: str = "none"
    default_sliding_window: int | None = None
    # RoPE where config.json leaves it out: the theta, and the whole rope dict when it has neither
    # rope_scaling nor rope_parameters (gpt-oss: YaRN).
    rope_theta: float = 10_000.0
    rope_parameters: Mapping[str, Any] | None = None
    # Partial rotary embeddings (GLM-4.5): the family's partial_rotary_factor where config.json has none;
    # None: the family rotates whole heads, and a factor != 1 is refused.
    partial_rotary_factor: float | None = None
    # DeepSeek-V3-style routing (DeepSeek-V3, GLM-4.5): sigmoid scores, group-limited choice, routed
    # scaling, shared experts and the first layers dense. None: the family routes by softmax. Otherwise the
    # family's defaults for n_group, topk_group, routed_scaling_factor, n_shared_experts and
    # first_k_dense_replace, read when config.json leaves them out.
    grouped_sigmoid_routing: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding: base ``theta`` and an optional frequency scaling (``kind``).

    YaRN (``kind="yarn"``) scales the frequencies by ``factor`` outside a band of channels and blends
    in between; the band is where a channel turns between ``beta_slow`` and ``beta_fast`` times over
    ``original_max_position_embeddings`` positions, widened to whole channels when ``truncate``. It
    also multiplies cos/sin by an attention factor: ``attention_factor`` when given, else one derived
    from ``factor`` and, when both are non-zero, ``mscale`` / ``mscale_all_dim`` (None or 0: unused,
    as in transformers).
    """

    theta: float
    kind: str = "default"
    factor: float = 1.0  # linear, llama3 and yarn
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 8192  # llama3 and yarn
    beta_fast: float = 32.0  # yarn: rotations over the original context above which a channel keeps its frequency
    beta_slow: float = 1.0  # yarn: rotations below which a channel is fully scaled by factor
    truncate: bool = True  # yarn: round the blend band outward to whole channels
    attention_factor: float | None = None  # yarn: cos/sin multiplier; None derives it from factor and mscale
    mscale: float | None = None  # yarn: numerator weight of log(factor) in the derived attention factor
    mscale_all_dim: float | None = None  # yarn: denominator weight of log(factor) in the derived attention factor


@dataclass(frozen=True)
class MoeConfig:
    """Routed experts of a sparse layer and which layers are sparse."""

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # The checkpoint's load-balancing convention: train on CE + router_aux_loss_coef * aux when
    # output_router_logits is true (transformers' load_balancing_loss_func; SPEC LB-2).
    output_router_logits: bool = False
    router_aux_loss_coef: float = 0.001
    # The routers carry e_score_correction_bias (a family trait): bias balancing can move it.
    selection_bias: bool = False
    # gpt-oss: a bias on the router logits and on both expert projections, interleaved (gate, up)
    # features and a clamped SwiGLU (GatedActivation).
    router_bias: bool = False
    expert_bias: bool = False
    activation: GatedActivation = SWIGLU
    # Router scoring: "softmax" over all experts, or "sigmoid" per expert (DeepSeek-V3, GLM-4.5), then
    # top-k within the best `topk_group` of `n_group` expert groups (a group scores the sum of its two
    # best experts), and the kept weights times `routed_scaling_factor`.
    scoring: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    # Shared experts: a dense SwiGLU of this width every token runs besides the routed ones (0: none);
    # with `shared_expert_gate` its output is scaled by sigmoid(x @ w), w [1, H] (Qwen2-MoE).
    shared_expert_intermediate_size: int = 0
    shared_expert_gate: bool = False

    def is_sparse(self, layer_idx: int) -> bool:
        """Layer ``layer_idx`` routes through experts, unless listed in ``mlp_only_layers`` or off-step."""
        return layer_idx not in self.mlp_only_layers and (layer_idx + 1) % self.decoder_sparse_step == 0


@dataclass(frozen=True)
class MlaConfig:
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2): low-rank query and key/value projections.

    Each head's query and key are ``qk_nope_head_dim`` channels without position plus ``qk_rope_head_dim``
    rotated ones; the rotated key part is one per token, shared by every head. ``q_lora_rank`` None: a
    plain ``q_proj``. ``rope_interleave``: the rotated channels pair as (0, 1), (2, 3), ... (else as
    (i, i + d/2)). ``softmax_scale`` multiplies ``q k^T`` (``(nope + rope)^-0.5``, times YaRN's mscale^2).
    """

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool
    softmax_scale: float

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder-only causal LM (Llama, Qwen3, Qwen3-MoE)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    # o_proj's bias when it differs from q/k/v's (Qwen2-MoE, GLM-4.5: biases on q/k/v only); None: attention_bias.
    attention_output_bias: bool | None = None
    mlp_bias: bool = False
    qk_norm: bool = False
    initializer_range: float = 0.02
    moe: MoeConfig | None = None
    pad_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Sliding-window attention: layer i attends to the last `sliding_window` positions when
    # layer_types[i] == "sliding_attention" (layer_types empty: every layer is full attention).
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    # gpt-oss: a learned per-head logit that takes softmax mass in every attention row.
    attention_sinks: bool = False
    # Partial rotary embeddings (GLM-4.5): only the first rotary_dim channels of each head rotate (None: all).
    rotary_dim: int | None = None
    # DeepSeek-V3's multi-head latent attention in place of grouped-query attention.
    mla: MlaConfig | None = None
    raw: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def layer_is_sparse(self, layer_idx: int) -> bool:
        return self.moe is not None and self.moe.is_sparse(layer_idx)

    def sparse_slots(self) -> dict[int, int]:
        """Each sparse layer's index -> its slot ``j`` among the sparse layers (the ``L_moe`` axis of routes)."""
        sparse = [i for i in range(self.num_hidden_layers) if self.layer_is_sparse(i)]
        return {layer: slot for slot, layer in enumerate(sparse)}

    @property
    def rope_dim(self) -> int:
        """Channels of a head that RoPE rotates: MLA's rope part, a partial rotary share, or the whole head."""
        if self.mla is not None:
            return self.mla.qk_rope_head_dim
        return self.rotary_dim if self.rotary_dim is not None else self.head_dim

    def attention_window(self, layer_idx: int) -> int | None:
        """The sliding window of layer ``layer_idx``, or None for full causal attention."""
        if self.layer_types and self.layer_types[layer_idx] == SLIDING_ATTENTION:
            return self.sliding_window
        return None


def read_config_file(directory: str | Path) -> dict[str, Any]:
    """The JSON object of ``directory/config.json``."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise ValueError(f"no config.json in {directory}")
    with path.open() as f:
        try:
            raw = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(raw).__name__}")
    return raw


def parse_decoder_config(raw: Mapping[str, Any], defaults: ConfigDefaults) -> ModelConfig:
    """Build a :class:`ModelConfig` from the dict of a ``config.json`` of a family with ``defaults``."""
    model_type = str(raw.get("model_type"))
    fields = ConfigFields(raw, model_type)
    _reject_unimplemented(fields, defaults)
    hidden_size = fields.positive_int("hidden_size")
    num_heads = fields.positive_int("num_attention_heads")
    num_kv_heads = fields.positive_int("num_key_value_heads", default=num_heads)
    if num_heads % num_kv_heads:
        raise ValueError(
            f"config.json num_attention_heads={num_heads} must be a multiple of num_key_value_heads={num_kv_heads}"
        )
    max_positions = fields.positive_int("max_position_embeddings", default=defaults.max_position_embeddings)
    num_layers = fields.positive_int("num_hidden_layers")
    sliding_window, layer_types = _parse_sliding_window(fields, defaults, num_layers)
    head_dim = fields.positive_int("head_dim", default=defaults.head_dim or hidden_size // num_heads)
    config = ModelConfig(
        model_type=model_type,
        vocab_size=fields.positive_int("vocab_size"),
        hidden_size=hidden_size,
        intermediate_size=fields.positive_int("intermediate_size"),
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=fields.positive_float("rms_norm_eps", default=defaults.rms_norm_eps),
        rope=_parse_rope(fields, max_positions, defaults),
        max_position_embeddings=max_positions,
        tie_word_embeddings=fields.boolean("tie_word_embeddings", default=False),
        attention_bias=fields.boolean("attention_bias", default=defaults.attention_bias),
        mlp_bias=fields.boolean("mlp_bias", default=False) if defaults.has_mlp_bias else False,
        qk_norm=defaults.qk_norm,
        initializer_range=fields.positive_float("initializer_range", default=0.02),
        moe=_parse_moe(fields, defaults) if defaults.has_moe else None,
        pad_token_id=fields.optional_token_id("pad_token_id"),
        eos_token_ids=fields.token_ids("eos_token_id"),
        sliding_window=sliding_window,
        layer_types=layer_types,
        rotary_dim=_parse_rotary_dim(fields, defaults, head_dim),
        raw=dict(raw),
    )
    if config.head_dim % 2:
        raise ValueError(f"config.json head_dim={config.head_dim} must be even for rotary embeddings")
    if config.pad_token_id is not None and config.pad_token_id >= config.vocab_size:
        raise ValueError(
            f"config.json pad_token_id={config.pad_token_id} must be a token id below vocab_size={config.vocab_size}"
        )
    return config


def _parse_sliding_window(
    fields: ConfigFields, defaults: ConfigDefaults, num_layers: int
) -> tuple[int | None, tuple[str, ...]]:
    """``(sliding_window, layer_types)`` as the family reads them (see :attr:`ConfigDefaults.sliding_window`)."""
    if defaults.sliding_window == "none":
        return None, ()
    window = fields.raw.get("sliding_window", defaults.default_sliding_window)
    if window is not None and (not _is_int(window) or window <= 0):
        raise ValueError(f"config.json field 'sliding_window' must be a positive integer or null, got {window!r}")
    if defaults.sliding_window == "all":
        return window, (SLIDING_ATTENTION,) * num_layers if window is not None else ()
    kinds = fields.raw.get("layer_types")
    if kinds is None:  # the family's default: sliding, full, sliding, ...
        kinds = [SLIDING_ATTENTION if i % 2 == 0 else FULL_ATTENTION for i in range(num_layers)]
    allowed = (SLIDING_ATTENTION, FULL_ATTENTION)
    if not isinstance(kinds, list) or len(kinds) != num_layers or any(kind not in allowed for kind in kinds):
        raise ValueError(
            f"config.json field 'layer_types' must list one of {allowed} for each of the {num_layers} layers, "
            f"got {kinds!r}"
        )
    if SLIDING_ATTENTION in kinds and window is None:
        raise ValueError("config.json layer_types has sliding_attention layers but sliding_window is null")
    return window, tuple(kinds)


def _rope_dict(fields: ConfigFields) -> Any:
    return fields.get("rope_scaling", None) or fields.get("rope_parameters", None)


def _parse_rotary_dim(fields: ConfigFields, defaults: ConfigDefaults, head_dim: int) -> int | None:
    """``int(head_dim * partial_rotary_factor)`` (the rope dict's factor, else the top-level one, else the family's),
    or None when every channel rotates."""
    if defaults.partial_rotary_factor is None:
        return None
    params = _rope_dict(fields)
    factor = params.get("partial_rotary_factor") if isinstance(params, dict) else None
    if factor is None:
        factor = fields.get("partial_rotary_factor", defaults.partial_rotary_factor)
    if not _is_number(factor) or not 0 < factor <= 1:
        raise ValueError(f"config.json partial_rotary_factor must be a number in (0, 1], got {factor!r}")
    rotary_dim = int(head_dim * factor)
    if rotary_dim < 2 or rotary_dim % 2:
        raise ValueError(
            f"config.json partial_rotary_factor={factor} of head_dim={head_dim} rotates {rotary_dim} channels; "
            "rotary embeddings need an even number of at least 2"
        )
    return None if rotary_dim == head_dim else rotary_dim


def _reject_unimplemented(fields: ConfigFields, defaults: ConfigDefaults) -> None:
    """Fields whose non-default value changes the model in a way raymoe does not implement."""
    if fields.get("hidden_act", "silu") not in ("silu", "swish"):  # two names of one function
        raise ValueError(f"config.json hidden_act={fields.get('hidden_act', None)!r}: only 'silu' is implemented")
    if fields.get("use_sliding_window", False):
        raise ValueError("config.json use_sliding_window=true: sliding-window attention is not implemented in raymoe")
    if fields.get("attention_dropout", 0.0):
        raise ValueError("config.json attention_dropout != 0: attention dropout is not implemented in raymoe")
    params = _rope_dict(fields)
    partial = params.get("partial_rotary_factor") if isinstance(params, dict) else None
    partial = fields.get("partial_rotary_factor", 1.0) if partial is None else partial
    if defaults.partial_rotary_factor is None and partial != 1.0:
        raise ValueError(
            f"config.json partial_rotary_factor={partial!r}: partial rotary embeddings are not implemented for "
            f"model_type={fields.model_type!r}"
        )


def _parse_moe(fields: ConfigFields, defaults: ConfigDefaults) -> MoeConfig:
    # transformers writes num_experts as num_local_experts (its attribute_map); hub configs use num_experts.
    experts_key = next(
        (key for key in ("num_experts", "n_routed_experts", "num_local_experts") if key in fields.raw), "num_experts"
    )
    num_experts = fields.positive_int(experts_key)
    top_k = fields.positive_int("num_experts_per_tok")
    if top_k > num_experts:
        raise ValueError(f"config.json num_experts_per_tok={top_k} exceeds {experts_key}={num_experts}")
    num_layers = fields.positive_int("num_hidden_layers")
    mlp_only = fields.get("mlp_only_layers", None) or []
    if not isinstance(mlp_only, list) or not all(_is_int(i) and 0 <= i < num_layers for i in mlp_only):
        raise ValueError(f"config.json mlp_only_layers={mlp_only!r} must list layer indices in [0, {num_layers})")
    routing: dict[str, Any] = {}
    if defaults.grouped_sigmoid_routing is not None:
        routing, mlp_only = _parse_grouped_sigmoid_routing(fields, defaults.grouped_sigmoid_routing, num_experts, top_k)
    return MoeConfig(
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=fields.positive_int(defaults.expert_size_field),
        norm_topk_prob=_norm_topk_prob(fields, defaults),
        decoder_sparse_step=fields.positive_int("decoder_sparse_step", default=1),
        mlp_only_layers=tuple(mlp_only),
        output_router_logits=fields.boolean("output_router_logits", default=False),
        router_aux_loss_coef=fields.non_negative_float("router_aux_loss_coef", default=0.001),
        selection_bias=defaults.router_selection_bias,
        **routing,
    )


def _parse_grouped_sigmoid_routing(
    fields: ConfigFields, family: Mapping[str, Any], num_experts: int, top_k: int
) -> tuple[dict[str, Any], list[int]]:
    """DeepSeek-V3-style routing: the :class:`MoeConfig` fields it sets and the dense first layers."""

    def count(key: str) -> int:  # a non-negative integer field
        value = fields.get(key, family[key])
        if not _is_int(value) or value < 0:
            raise ValueError(f"config.json field {key!r} must be an integer >= 0, got {value!r}")
        return int(value)

    n_group, topk_group = (
        fields.positive_int("n_group", family["n_group"]),
        fields.positive_int("topk_group", family["topk_group"]),
    )
    if num_experts % n_group:
        raise ValueError(f"config.json n_group={n_group} must divide the {num_experts} routed experts")
    if topk_group > n_group:
        raise ValueError(f"config.json topk_group={topk_group} exceeds n_group={n_group}")
    per_group = num_experts // n_group
    if n_group > 1 and per_group < 2:
        raise ValueError(
            f"config.json n_group={n_group}: each group needs at least 2 of the {num_experts} experts (a group scores "
            "its two best)"
        )
    if n_group > 1 and top_k > topk_group * per_group:
        raise ValueError(
            f"config.json num_experts_per_tok={top_k} exceeds the {topk_group * per_group} experts of topk_group="
            f"{topk_group} groups of {per_group}"
        )
    first_dense = count("first_k_dense_replace")
    num_layers = fields.positive_int("num_hidden_layers")
    if first_dense > num_layers:
        raise ValueError(f"config.json first_k_dense_replace={first_dense} exceeds num_hidden_layers={num_layers}")
    shared = count("n_shared_experts")
    routing = {
        "scoring": "sigmoid",
        "n_group": n_group,
        "topk_group": topk_group,
        "routed_scaling_factor": fields.positive_float("routed_scaling_factor", family["routed_scaling_factor"]),
        "shared_expert_intermediate_size": shared * fields.positive_int("moe_intermediate_size"),
    }
    return routing, list(range(first_dense))


def _norm_topk_prob(fields: ConfigFields, defaults: ConfigDefaults) -> bool:
    """The family's fixed choice, or the config's ``norm_topk_prob`` (default false)."""
    if defaults.norm_topk_prob is not None:
        return defaults.norm_topk_prob
    return fields.boolean("norm_topk_prob", default=False)


def _parse_rope(fields: ConfigFields, max_positions: int, defaults: ConfigDefaults) -> RopeConfig:
    # Hub configs spell this three ways: legacy `rope_scaling` (+ top-level `rope_theta`), or
    # transformers 5's `rope_parameters` holding the theta too. `rope_scaling` wins, as in transformers.
    params = fields.get("rope_scaling", None) or fields.get("rope_parameters", None) or defaults.rope_parameters or {}
    if not isinstance(params, dict):
        raise ValueError(f"config.json rope_scaling/rope_parameters must be an object, got {params!r}")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"config.json rope_type={kind!r} is not implemented in raymoe; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    theta = _positive_number("rope_theta", params.get("rope_theta", fields.get("rope_theta", defaults.rope_theta)))
    if kind == "default":
        return RopeConfig(theta=theta)
    if kind == "yarn":
        return _parse_yarn(fields, params, theta, max_positions)
    factor = _positive_number(f"rope {kind} scaling 'factor'", params.get("factor"))
    if kind == "linear":
        return RopeConfig(theta=theta, kind=kind, factor=factor)
    low = _positive_number("rope llama3 scaling 'low_freq_factor'", params.get("low_freq_factor"))
    high = _positive_number("rope llama3 scaling 'high_freq_factor'", params.get("high_freq_factor"))
    if high <= low:
        raise ValueError(f"config.json llama3 rope scaling needs low_freq_factor < high_freq_factor, got {low}, {high}")
    # A top-level original_max_position_embeddings overrides the one in the rope dict (transformers does the same).
    original = fields.get("original_max_position_embeddings", params.get("original_max_position_embeddings"))
    return RopeConfig(
        theta=theta,
        kind=kind,
        factor=factor,
        low_freq_factor=low,
        high_freq_factor=high,
        original_max_position_embeddings=int(original) if _is_int(original) else max_positions,
    )


def _parse_yarn(fields: ConfigFields, params: Mapping[str, Any], theta: float, max_positions: int) -> RopeConfig:
    """The YaRN fields of ``params`` (the rope dict); null or absent optional fields take transformers' defaults."""
    # The pretraining context: a top-level field wins over the rope dict's, then max_position_embeddings
    # (transformers' order). An absent factor is the ratio of the extended to the pretraining context.
    original = fields.get("original_max_position_embeddings", params.get("original_max_position_embeddings"))
    if original is None:
        original = max_positions
    elif not _is_int(original) or original <= 0:
        raise ValueError(
            "config.json rope yarn scaling 'original_max_position_embeddings' must be a positive integer, "
            f"got {original!r}"
        )
    if params.get("factor") is None:
        factor = max_positions / original
        source = f"max_position_embeddings / original_max_position_embeddings = {max_positions} / {original}"
    else:
        factor = _positive_number("rope yarn scaling 'factor'", params.get("factor"))
        source = "the rope dict"
    if factor < 1:
        raise ValueError(f"config.json rope yarn scaling 'factor' must be >= 1, got {factor!r} from {source}")
    beta_fast = _optional_positive("rope yarn scaling 'beta_fast'", params.get("beta_fast")) or 32.0
    beta_slow = _optional_positive("rope yarn scaling 'beta_slow'", params.get("beta_slow")) or 1.0
    if beta_fast < beta_slow:
        raise ValueError(
            "config.json rope yarn scaling needs beta_fast >= beta_slow, "
            f"got beta_fast={beta_fast}, beta_slow={beta_slow}"
        )
    truncate = params.get("truncate", True)
    if not isinstance(truncate, bool):
        raise ValueError(f"config.json rope yarn scaling 'truncate' must be true or false, got {truncate!r}")
    return RopeConfig(
        theta=theta,
        kind="yarn",
        factor=factor,
        original_max_position_embeddings=int(original),
        beta_fast=beta_fast,
        beta_slow=beta_slow,
        truncate=truncate,
        attention_factor=_optional_positive("rope yarn scaling 'attention_factor'", params.get("attention_factor")),
        mscale=_optional_non_negative("rope yarn scaling 'mscale'", params.get("mscale")),
        mscale_all_dim=_optional_non_negative("rope yarn scaling 'mscale_all_dim'", params.get("mscale_all_dim")),
    )


def _optional_positive(what: str, value: Any) -> float | None:
    return None if value is None else _positive_number(what, value)


def _optional_non_negative(what: str, value: Any) -> float | None:
    if value is None:
        return None
    if not _is_number(value) or not math.isfinite(value) or value < 0:
        raise ValueError(f"config.json {what} must be a number >= 0, got {value!r}")
    return float(value)


def _positive_number(what: str, value: Any) -> float:
    if not _is_number(value) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"config.json {what} must be a positive number, got {value!r}")
    return float(value)


class ConfigFields:
    """Typed reads of config.json fields; every error names the field, its value and the model type."""

    def __init__(self, raw: Mapping[str, Any], model_type: str) -> None:
        self.raw = raw
        self.model_type = model_type

    def get(self, key: str, default: Any) -> Any:
        value = self.raw.get(key, default)
        return default if value is None else value

    def _required(self, key: str, default: Any) -> Any:
        value = self.raw.get(key)
        if value is not None:
            return value
        if default is _MISSING:
            raise ValueError(f"config.json for model_type={self.model_type!r} is missing the required field {key!r}")
        return default

    def positive_int(self, key: str, default: Any = None) -> int:
        value = self._required(key, _MISSING if default is None else default)
        if not _is_int(value) or value <= 0:
            raise ValueError(f"config.json field {key!r} must be a positive integer, got {value!r}")
        return int(value)

    def positive_float(self, key: str, default: float) -> float:
        return _positive_number(f"field {key!r}", self._required(key, default))

    def non_negative_float(self, key: str, default: float) -> float:
        value = self._required(key, default)
        if not _is_number(value) or not math.isfinite(value) or value < 0:
            raise ValueError(f"config.json field {key!r} must be a number >= 0, got {value!r}")
        return float(value)

    def boolean(self, key: str, default: bool) -> bool:
        value = self._required(key, default)
        if not isinstance(value, bool):
            raise ValueError(f"config.json field {key!r} must be true or false, got {value!r}")
        return value

    def optional_token_id(self, key: str) -> int | None:
        value = self.raw.get(key)
        if value is not None and (not _is_int(value) or value < 0):
            raise ValueError(f"config.json field {key!r} must be a token id or null, got {value!r}")
        return value

    def token_ids(self, key: str) -> tuple[int, ...]:
        value = self.raw.get(key)
        values = value if isinstance(value, list) else [] if value is None else [value]
        if not all(_is_int(v) and v >= 0 for v in values):
            raise ValueError(f"config.json field {key!r} must be a token id, a list of them, or null, got {value!r}")
        return tuple(values)


_MISSING = object()


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
