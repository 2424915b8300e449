"""raymoe: a Ray-orchestrated distributed runtime for mixture-of-experts transformers.

The folders say which process runs the code (see ARCHITECTURE.md): ``spec/`` (driver, pure),
``models/`` (pure torch), ``parallel/`` (styles, FSDP2), ``rank/`` (inside a rank actor),
``driver/`` (handle, Trainer, data), ``checkpoint/`` (hub files); ``actors/`` beside this package
is the only code that imports ``ray``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from raymoe.api import from_pretrained, from_ray_dataset, load_dataset, plan, start_world
    from raymoe.checkpoint import load_model, save_model
    from raymoe.checkpoint.export import export_state
    from raymoe.driver.handle import DistributedModel
    from raymoe.driver.interrupts import TrainingInterrupted
    from raymoe.driver.packing import PackedData
    from raymoe.driver.recovery import TrainingFailed
    from raymoe.driver.step_records import TrainSummary
    from raymoe.driver.streamed_data import StreamedData
    from raymoe.driver.tiny import build_tiny_checkpoint
    from raymoe.driver.tokenizer import TextTokenizer, load_tokenizer
    from raymoe.driver.trainer import Trainer
    from raymoe.driver.trainer_config import TrainerConfig
    from raymoe.models.common.generation import generate
    from raymoe.parallel.styles import ExpertRole, ParallelStyle, register, unregister
    from raymoe.rank.local import LocalRankGroup
    from raymoe.spec.config import DistributedConfig
    from raymoe.spec.lora import LoraConfig
    from raymoe.spec.optimizer import OptimizerConfig
    from raymoe.spec.topology import Topology, build_topology

# Each public name and the module it lives in: imported on first use (PEP 562), so a rank process, which imports
# raymoe.rank.* and never the driver's modules, does not pay for them (`import actors.rank`: 2.15 -> 1.90 s).
_HOME = {
    "DistributedConfig": "raymoe.spec.config",
    "DistributedModel": "raymoe.driver.handle",
    "ExpertRole": "raymoe.parallel.styles",
    "LocalRankGroup": "raymoe.rank.local",
    "LoraConfig": "raymoe.spec.lora",
    "OptimizerConfig": "raymoe.spec.optimizer",
    "PackedData": "raymoe.driver.packing",
    "ParallelStyle": "raymoe.parallel.styles",
    "StreamedData": "raymoe.driver.streamed_data",
    "TextTokenizer": "raymoe.driver.tokenizer",
    "Topology": "raymoe.spec.topology",
    "TrainSummary": "raymoe.driver.step_records",
    "Trainer": "raymoe.driver.trainer",
    "TrainerConfig": "raymoe.driver.trainer_config",
    "TrainingFailed": "raymoe.driver.recovery",
    "TrainingInterrupted": "raymoe.driver.interrupts",
    "build_tiny_checkpoint": "raymoe.driver.tiny",
    "build_topology": "raymoe.spec.topology",
    "export_state": "raymoe.checkpoint.export",
    "from_pretrained": "raymoe.api",
    "from_ray_dataset": "raymoe.api",
    "generate": "raymoe.models.common.generation",
    "load_dataset": "raymoe.api",
    "load_model": "raymoe.checkpoint",
    "load_tokenizer": "raymoe.driver.tokenizer",
    "plan": "raymoe.api",
    "register": "raymoe.parallel.styles",
    "save_model": "raymoe.checkpoint",
    "start_world": "raymoe.api",
    "unregister": "raymoe.parallel.styles",
}


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'raymoe' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOME))


__all__ = [
    "DistributedConfig",
    "DistributedModel",
    "ExpertRole",
    "LocalRankGroup",
    "LoraConfig",
    "OptimizerConfig",
    "PackedData",
    "ParallelStyle",
    "StreamedData",
    "TextTokenizer",
    "Topology",
    "TrainSummary",
    "Trainer",
    "TrainerConfig",
    "TrainingFailed",
    "TrainingInterrupted",
    "build_tiny_checkpoint",
    "build_topology",
    "export_state",
    "from_pretrained",
    "from_ray_dataset",
    "generate",
    "load_dataset",
    "load_model",
    "load_tokenizer",
    "plan",
    "register",
    "save_model",
    "start_world",
    "unregister",
]
