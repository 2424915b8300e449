"""``model_type`` -> model class, and building a model from its config."""

from __future__ import annotations

import torch

from raymoe.models.config import ModelConfig
from raymoe.models.decoder import CausalLM
from raymoe.models.dense import LlamaForCausalLM, Qwen3ForCausalLM
from raymoe.models.qwen3_moe import Qwen3MoeForCausalLM

MODEL_CLASSES: dict[str, type[CausalLM]] = {
    "llama": LlamaForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
}


def build_model(
    config: ModelConfig, *, device: torch.device | str = "meta", dtype: torch.dtype = torch.float32
) -> CausalLM:
    """The model of ``config``: on ``meta`` (the default) shapes only, ready to load; elsewhere randomly initialised."""
    model_class = MODEL_CLASSES.get(config.model_type)
    if model_class is None:
        raise ValueError(f"model_type {config.model_type!r} is not supported; supported: {', '.join(MODEL_CLASSES)}")
    with torch.device(device):
        model = model_class(config)
    model.to(dtype)
    if torch.device(device).type != "meta":
        model.init_weights()
    return model
