"""raymoe: a Ray-orchestrated distributed runtime for mixture-of-experts transformers.

The folders say which process runs the code (see ARCHITECTURE.md): ``spec/`` (driver, pure),
``models/`` (pure torch), ``parallel/`` (styles, FSDP2), ``rank/`` (inside a rank actor),
``driver/`` (handle, Trainer, data), ``checkpoint/`` (hub files); ``actors/`` beside this package
is the only code that imports ``ray``.
"""

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
