"""Mixture-of-experts layer as small pieces: router -> grouped experts (one grouped-GEMM seam) -> block.

Expert-parallel styles wrap the router's or the experts' forward: the router returns expert ids
and weights separately, and the experts take them as arguments. ``balance.py`` holds the
load-balancing math (aux loss, bias step, capacity), on plain tensors.
"""

from raymoe.models.moe.block import SparseMoeBlock
from raymoe.models.moe.experts import GroupedExperts
from raymoe.models.moe.grouped_mm import GEMM_BACKENDS, GemmBackend, grouped_mm, select_gemm_backend
from raymoe.models.moe.router import RoutingRecord, TopKRouter

__all__ = [
    "GEMM_BACKENDS",
    "GemmBackend",
    "GroupedExperts",
    "RoutingRecord",
    "SparseMoeBlock",
    "TopKRouter",
    "grouped_mm",
    "select_gemm_backend",
]
