"""raymoe's own model definitions (torch only): Qwen3-MoE, Llama and Qwen3, hub-checkpoint compatible."""

from raymoe.models.config import (
    SUPPORTED_MODEL_TYPES,
    ModelConfig,
    MoeConfig,
    RopeConfig,
    load_model_config,
    parse_model_config,
)
from raymoe.models.decoder import CausalLM, DecoderLayer, DecoderModel
from raymoe.models.dense import LlamaForCausalLM, Qwen3ForCausalLM
from raymoe.models.hub_layout import Concat, HubKeys, HubLayout, Stack
from raymoe.models.kv_cache import KVCache
from raymoe.models.loss import causal_lm_loss
from raymoe.models.qwen3_moe import Qwen3MoeForCausalLM
from raymoe.models.registry import MODEL_CLASSES, build_model

__all__ = [
    "MODEL_CLASSES",
    "SUPPORTED_MODEL_TYPES",
    "CausalLM",
    "Concat",
    "DecoderLayer",
    "DecoderModel",
    "HubKeys",
    "HubLayout",
    "KVCache",
    "LlamaForCausalLM",
    "ModelConfig",
    "MoeConfig",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "RopeConfig",
    "Stack",
    "build_model",
    "causal_lm_loss",
    "load_model_config",
    "parse_model_config",
]
