"""raymoe: a Ray-orchestrated distributed runtime for mixture-of-experts transformers."""

from raymoe.api import from_pretrained
from raymoe.checkpoint import load_model, save_model
from raymoe.config import DistributedConfig
from raymoe.generation import generate
from raymoe.styles import ParallelStyle, register
from raymoe.topology import Topology, build_topology

__all__ = [
    "DistributedConfig",
    "ParallelStyle",
    "Topology",
    "build_topology",
    "from_pretrained",
    "generate",
    "load_model",
    "register",
    "save_model",
]
