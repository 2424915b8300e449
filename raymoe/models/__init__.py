"""raymoe's own model definitions (pure torch, nothing of distribution): Qwen3-MoE, Qwen2-MoE, GLM-4.5,
DeepSeek-V3, gpt-oss, Mixtral, Llama, Qwen3.

``common/`` holds the shared blocks, ``moe/`` the mixture-of-experts pieces, and each family has
one folder (model, config defaults, default plans, hub layout); :mod:`raymoe.models.registry`
maps ``model_type`` to the family. Nothing here imports ``raymoe.parallel``, ``raymoe.rank``,
``raymoe.driver`` or ``actors``: what the parallel layer needs to know about a module, the model
says with plain attributes (:mod:`raymoe.models.common.shard_hints`).
"""

from raymoe.models.common.config import ModelConfig, MoeConfig, RopeConfig
from raymoe.models.common.decoder import CausalLM, DecoderLayer, DecoderModel
from raymoe.models.common.hub_layout import Concat, Fp8Block, HubKeys, HubLayout, Mxfp4, Stack, Transpose
from raymoe.models.common.kv_cache import KVCache
from raymoe.models.common.loss import causal_lm_loss
from raymoe.models.common.plans import DefaultPlans
from raymoe.models.deepseek_v3 import DeepseekV3ForCausalLM
from raymoe.models.glm4_moe import Glm4MoeForCausalLM
from raymoe.models.gpt_oss import GptOssForCausalLM
from raymoe.models.llama import LlamaForCausalLM
from raymoe.models.mixtral import MixtralForCausalLM
from raymoe.models.qwen2_moe import Qwen2MoeForCausalLM
from raymoe.models.qwen3 import Qwen3ForCausalLM
from raymoe.models.qwen3_moe import Qwen3MoeForCausalLM
from raymoe.models.registry import (
    FAMILIES,
    MODEL_CLASSES,
    SUPPORTED_MODEL_TYPES,
    build_model,
    load_model_config,
    parse_model_config,
)

__all__ = [
    "FAMILIES",
    "MODEL_CLASSES",
    "SUPPORTED_MODEL_TYPES",
    "CausalLM",
    "Concat",
    "DecoderLayer",
    "DecoderModel",
    "DeepseekV3ForCausalLM",
    "DefaultPlans",
    "Fp8Block",
    "Glm4MoeForCausalLM",
    "GptOssForCausalLM",
    "HubKeys",
    "HubLayout",
    "KVCache",
    "LlamaForCausalLM",
    "MixtralForCausalLM",
    "ModelConfig",
    "MoeConfig",
    "Mxfp4",
    "Qwen2MoeForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "RopeConfig",
    "Stack",
    "Transpose",
    "build_model",
    "causal_lm_loss",
    "load_model_config",
    "parse_model_config",
]
