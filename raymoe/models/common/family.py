"""What a model family is to the rest of raymoe: its ``model_type``, config defaults and model class."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from raymoe.models.common.config import ConfigDefaults, ModelConfig, parse_decoder_config
from raymoe.models.common.decoder import CausalLM


@dataclass(frozen=True)
class ModelFamily:
    """One folder under ``raymoe/models/``: how to read its ``config.json`` and which class it builds."""

    model_type: str
    defaults: ConfigDefaults
    model_class: type[CausalLM]

    def parse_config(self, raw: Mapping[str, Any]) -> ModelConfig:
        return parse_decoder_config(raw, self.defaults)
