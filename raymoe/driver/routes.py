"""Routes for router replay, checked on the driver: ``routed_experts [B, S, L_moe, K]`` global expert ids.

``L_moe`` is the model's count of sparse layers (slot ``j`` the ``j``-th, ``ModelConfig.sparse_slots``) and
``K`` its ``num_experts_per_tok``; ids lie in ``[0, num_experts)``. They travel as int16.
"""

from __future__ import annotations

import torch
from torch import Tensor

from raymoe.models.common.config import ModelConfig

ROUTE_DTYPE = torch.int16


def route_shape(config: ModelConfig, rows: int, width: int) -> tuple[int, int, int, int]:
    if config.moe is None:
        raise ValueError(f"router replay: {config.model_type} is a dense model (no experts, no routes)")
    return rows, width, len(config.sparse_slots()), config.moe.num_experts_per_tok


def check_routes(routes: object, config: ModelConfig, ids: Tensor, method: str) -> Tensor:
    """``routed_experts`` as a ``[B, S, L_moe, K]`` int16 CPU tensor, or one ``ValueError`` naming the problem."""
    expected = route_shape(config, int(ids.shape[0]), int(ids.shape[1]))
    if not isinstance(routes, Tensor):
        raise ValueError(
            f"{method}: routed_experts must be a tensor {list(expected)} [B, S, L_moe, K], got {type(routes).__name__}"
        )
    if routes.dtype.is_floating_point or routes.dtype == torch.bool or routes.is_complex():
        raise ValueError(f"{method}: routed_experts must hold integer expert ids, got dtype {routes.dtype}")
    if tuple(routes.shape) != expected:
        raise ValueError(
            f"{method}: routed_experts has shape {list(routes.shape)}; expected {list(expected)}: [B, S] like "
            f"input_ids, L_moe={expected[2]} sparse layers, K={expected[3]} experts per token"
        )
    assert config.moe is not None
    experts = config.moe.num_experts
    low, high = int(routes.min()), int(routes.max())
    if low < 0 or high >= experts:
        raise ValueError(
            f"{method}: routed_experts must be expert ids in [0, {experts}), got values in [{low}, {high}]"
        )
    return routes.detach().to("cpu", ROUTE_DTYPE)
