"""raymoe: a Ray-orchestrated distributed runtime for mixture-of-experts transformers."""

from raymoe.config import DistributedConfig
from raymoe.styles import ParallelStyle, register
from raymoe.topology import Topology, build_topology

__all__ = ["DistributedConfig", "ParallelStyle", "Topology", "build_topology", "register"]
