"""``model_type`` -> model family, and the calls that need one: parse a config, build a model.

Adding a family is one folder under ``raymoe/models/`` (model, config defaults, default plans, hub
layout) and one entry in :data:`FAMILIES`.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from raymoe.models import deepseek_v3, glm4_moe, gpt_oss, llama, mixtral, qwen2_moe, qwen3, qwen3_moe
from raymoe.models.common.config import ModelConfig, read_config_file
from raymoe.models.common.decoder import CausalLM
from raymoe.models.common.family import ModelFamily
from raymoe.models.common.skip_init import SkipMetaInit

FAMILIES: dict[str, ModelFamily] = {
    family.model_type: family
    for family in (
        llama.FAMILY,
        qwen3.FAMILY,
        qwen3_moe.FAMILY,
        qwen2_moe.FAMILY,
        glm4_moe.FAMILY,
        deepseek_v3.FAMILY,
        mixtral.FAMILY,
        gpt_oss.FAMILY,
    )
}
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)
MODEL_CLASSES: dict[str, type[CausalLM]] = {name: family.model_class for name, family in FAMILIES.items()}


def family_of(model_type: object) -> ModelFamily:
    """The family of ``model_type``, or a ``ValueError`` listing the supported ones."""
    family = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        raise ValueError(
            f"config.json model_type={model_type!r} is not supported; supported model types: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    return family


def parse_model_config(raw: Mapping[str, Any]) -> ModelConfig:
    """Build a :class:`ModelConfig` from the dict of a ``config.json``, with its family's defaults."""
    return family_of(raw.get("model_type")).parse_config(raw)


def load_model_config(directory: str | Path) -> ModelConfig:
    """Parse ``directory/config.json``."""
    return parse_model_config(read_config_file(directory))


def build_model(
    config: ModelConfig, *, device: torch.device | str = "meta", dtype: torch.dtype = torch.float32
) -> CausalLM:
    """The model of ``config``: on ``meta`` (the default) shapes only, ready to load, built without running an
    initialiser (:class:`~raymoe.models.common.skip_init.SkipMetaInit`); elsewhere randomly initialised."""
    model_class = family_of(config.model_type).model_class
    with torch.device(device), SkipMetaInit():
        model = model_class(config)
    model.to(dtype)
    if torch.device(device).type != "meta":
        model.init_weights()
    return model
