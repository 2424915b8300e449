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

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
_DEFAULT_ROPE_THETA = 10_000.0


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


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding: base ``theta`` and an optional frequency scaling (``kind``)."""

    theta: float
    kind: str = "default"
    factor: float = 1.0  # linear and llama3
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 8192  # llama3


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

    def is_sparse(self, layer_idx: int) -> bool:
        """Layer ``layer_idx`` routes through experts, unless listed in ``mlp_only_layers`` or off-step."""
        return layer_idx not in self.mlp_only_layers and (layer_idx + 1) % self.decoder_sparse_step == 0


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
    mlp_bias: bool = False
    qk_norm: bool = False
    initializer_range: float = 0.02
    moe: MoeConfig | None = None
    pad_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    raw: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def layer_is_sparse(self, layer_idx: int) -> bool:
        return self.moe is not None and self.moe.is_sparse(layer_idx)


def read_config_file(directory: str | Path) -> dict[str, Any]:
    """The JSON object of ``directory/config.json``."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise ValueError(f"no config.json in {directory}")
    with path.open() as f:
        raw = json.load(f)
    if not isinstance(raw, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(raw).__name__}")
    return raw


def parse_decoder_config(raw: Mapping[str, Any], defaults: ConfigDefaults) -> ModelConfig:
    """Build a :class:`ModelConfig` from the dict of a ``config.json`` of a family with ``defaults``."""
    model_type = str(raw.get("model_type"))
    fields = _Fields(raw, model_type)
    _reject_unimplemented(fields)
    hidden_size = fields.positive_int("hidden_size")
    num_heads = fields.positive_int("num_attention_heads")
    num_kv_heads = fields.positive_int("num_key_value_heads", default=num_heads)
    if num_heads % num_kv_heads:
        raise ValueError(
            f"config.json num_attention_heads={num_heads} must be a multiple of num_key_value_heads={num_kv_heads}"
        )
    max_positions = fields.positive_int("max_position_embeddings", default=defaults.max_position_embeddings)
    config = ModelConfig(
        model_type=model_type,
        vocab_size=fields.positive_int("vocab_size"),
        hidden_size=hidden_size,
        intermediate_size=fields.positive_int("intermediate_size"),
        num_hidden_layers=fields.positive_int("num_hidden_layers"),
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=fields.positive_int("head_dim", default=defaults.head_dim or hidden_size // num_heads),
        rms_norm_eps=fields.positive_float("rms_norm_eps", default=1e-6),
        rope=_parse_rope(fields, max_positions),
        max_position_embeddings=max_positions,
        tie_word_embeddings=fields.boolean("tie_word_embeddings", default=False),
        attention_bias=fields.boolean("attention_bias", default=False),
        mlp_bias=fields.boolean("mlp_bias", default=False) if defaults.has_mlp_bias else False,
        qk_norm=defaults.qk_norm,
        initializer_range=fields.positive_float("initializer_range", default=0.02),
        moe=_parse_moe(fields, defaults.router_selection_bias) if defaults.has_moe else None,
        pad_token_id=fields.optional_token_id("pad_token_id"),
        eos_token_ids=fields.token_ids("eos_token_id"),
        raw=dict(raw),
    )
    if config.head_dim % 2:
        raise ValueError(f"config.json head_dim={config.head_dim} must be even for rotary embeddings")
    if config.pad_token_id is not None and config.pad_token_id >= config.vocab_size:
        raise ValueError(
            f"config.json pad_token_id={config.pad_token_id} must be a token id below vocab_size={config.vocab_size}"
        )
    return config


def _reject_unimplemented(fields: _Fields) -> None:
    """Fields whose non-default value changes the model in a way raymoe does not implement."""
    if fields.get("hidden_act", "silu") not in ("silu", "swish"):  # two names of one function
        raise ValueError(f"config.json hidden_act={fields.get('hidden_act', None)!r}: only 'silu' is implemented")
    if fields.get("use_sliding_window", False):
        raise ValueError("config.json use_sliding_window=true: sliding-window attention is not implemented in raymoe")
    if fields.get("attention_dropout", 0.0):
        raise ValueError("config.json attention_dropout != 0: attention dropout is not implemented in raymoe")
    if fields.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("config.json partial_rotary_factor != 1: partial rotary embeddings are not implemented")


def _parse_moe(fields: _Fields, selection_bias: bool) -> MoeConfig:
    # transformers writes num_experts as num_local_experts (its attribute_map); hub configs use num_experts.
    experts_key = (
        "num_local_experts" if "num_experts" not in fields.raw and "num_local_experts" in fields.raw else "num_experts"
    )
    num_experts = fields.positive_int(experts_key)
    top_k = fields.positive_int("num_experts_per_tok")
    if top_k > num_experts:
        raise ValueError(f"config.json num_experts_per_tok={top_k} exceeds {experts_key}={num_experts}")
    num_layers = fields.positive_int("num_hidden_layers")
    mlp_only = fields.get("mlp_only_layers", None) or []
    if not isinstance(mlp_only, list) or not all(_is_int(i) and 0 <= i < num_layers for i in mlp_only):
        raise ValueError(f"config.json mlp_only_layers={mlp_only!r} must list layer indices in [0, {num_layers})")
    return MoeConfig(
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=fields.positive_int("moe_intermediate_size"),
        norm_topk_prob=fields.boolean("norm_topk_prob", default=False),
        decoder_sparse_step=fields.positive_int("decoder_sparse_step", default=1),
        mlp_only_layers=tuple(mlp_only),
        output_router_logits=fields.boolean("output_router_logits", default=False),
        router_aux_loss_coef=fields.non_negative_float("router_aux_loss_coef", default=0.001),
        selection_bias=selection_bias,
    )


def _parse_rope(fields: _Fields, max_positions: int) -> RopeConfig:
    # Hub configs spell this three ways: legacy `rope_scaling` (+ top-level `rope_theta`), or
    # transformers 5's `rope_parameters` holding the theta too. `rope_scaling` wins, as in transformers.
    params = fields.get("rope_scaling", None) or fields.get("rope_parameters", None) or {}
    if not isinstance(params, dict):
        raise ValueError(f"config.json rope_scaling/rope_parameters must be an object, got {params!r}")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"config.json rope_type={kind!r} is not implemented in raymoe; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    theta = _positive_number("rope_theta", params.get("rope_theta", fields.get("rope_theta", _DEFAULT_ROPE_THETA)))
    if kind == "default":
        return RopeConfig(theta=theta)
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


def _positive_number(what: str, value: Any) -> float:
    if not _is_number(value) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"config.json {what} must be a positive number, got {value!r}")
    return float(value)


class _Fields:
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
