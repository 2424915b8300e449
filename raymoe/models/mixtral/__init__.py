"""Mixtral (mistralai/Mixtral-8x7B-v0.1, Mixtral-8x22B), the ``mixtral`` model type."""

from raymoe.models.common.family import ModelFamily
from raymoe.models.mixtral.config import MIXTRAL_DEFAULTS, parse_mixtral_config
from raymoe.models.mixtral.model import MixtralForCausalLM

FAMILY = ModelFamily("mixtral", MIXTRAL_DEFAULTS, MixtralForCausalLM, parse=parse_mixtral_config)

__all__ = ["FAMILY", "MIXTRAL_DEFAULTS", "MixtralForCausalLM"]
