"""raymoe: a Ray-orchestrated distributed runtime for mixture-of-experts transformers."""

from raymoe.api import from_pretrained
from raymoe.checkpoint import load_model, save_model
from raymoe.config import DistributedConfig
from raymoe.data import PackedData, TextTokenizer, load_dataset, load_tokenizer
from raymoe.generation import generate
from raymoe.styles import ParallelStyle, register
from raymoe.tiny import build_tiny_checkpoint
from raymoe.topology import Topology, build_topology
from raymoe.trainer import Trainer, TrainerConfig, TrainSummary

__all__ = [
    "DistributedConfig",
    "PackedData",
    "ParallelStyle",
    "TextTokenizer",
    "Topology",
    "TrainSummary",
    "Trainer",
    "TrainerConfig",
    "build_tiny_checkpoint",
    "build_topology",
    "from_pretrained",
    "generate",
    "load_dataset",
    "load_model",
    "load_tokenizer",
    "register",
    "save_model",
]
