"""Llama (dense; Llama 2 / 3 / 3.1 RoPE scalings), the ``llama`` model type."""

from raymoe.models.common.family import ModelFamily
from raymoe.models.llama.config import LLAMA_DEFAULTS
from raymoe.models.llama.model import LlamaForCausalLM

FAMILY = ModelFamily("llama", LLAMA_DEFAULTS, LlamaForCausalLM)

__all__ = ["FAMILY", "LLAMA_DEFAULTS", "LlamaForCausalLM"]
