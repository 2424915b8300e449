"""What a model family is to the rest of raymoe: its ``model_type``, config defaults and model class."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from raymoe.models.common.config import ConfigDefaults, ModelConfig, parse_decoder_config
from raymoe.models.common.decoder import CausalLM


@dataclass(frozen=True)
class ModelFamily:
    """One folder under ``raymoe/models/``: how to read its ``config.json`` and which class it builds.

    ``parse`` reads a ``config.json`` dict when the family has fields of its own (gpt-oss's clamped
    SwiGLU, Mixtral's router jitter); without it the shared decoder fields are read with ``defaults``.
    """

    model_type: str
    defaults: ConfigDefaults
    model_class: type[CausalLM]
    parse: Callable[[Mapping[str, Any]], ModelConfig] | None = None

    def parse_config(self, raw: Mapping[str, Any]) -> ModelConfig:
        if self.parse is not None:
            return self.parse(raw)
        return parse_decoder_config(raw, self.defaults)
