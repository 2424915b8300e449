"""Expert-parallel styles (SPEC §4, §5): expert weights split along the expert dim, and the two ways tokens meet them.

``mesh`` is the 1-D ep mesh (``ctx.mesh("ep")``) and ``P`` its size. Expert weights are ``[E, ...]``;
the rank at ep coordinate ``c`` holds experts ``[c * L, (c + 1) * L)``, ``L = E / P`` (TOPO-2,
``Topology.experts_of``)::

    style                 rule on               what it does
    grouped_gemm          each expert weight    Shard(0) over ep; the owning module's num_experts := L
    ep_router             the router            masking (EP-2): ids of own experts -> local ids, others masked
    ep_dispatch_experts   the experts module    token dispatch (EP-3…EP-5): forward replaced (dispatch.py)

Masking (``ep_router`` + ``moe_tp_experts``, ``ep_size == tp_size``: the ep group is the tp group and
holds one batch)::

    router -> ids [T, K] global, weights [T, K], logits [T, E]           Replicate
       | ep_router: id g in [c*L, (c+1)*L) -> g - c*L; any other g -> g - E < 0 (masked)
    experts on every token, local weights [L, ...]: a masked pair runs on local expert g mod L
       (so masked pairs spread evenly) but adds nothing and its weight gets no gradient
       | partial [T, H] -> all-reduce (moe_tp_experts) -> Replicate

Token dispatch with tp > 1 (EP-4), tp rank ``j`` of ``tp``::

    hidden [T, H], weights [T, K]   Replicate over tp; gradient all-reduced over tp (each rank's covers its rows)
       | rows chunk j of tp (torch.chunk sizes: uneven or empty slices are fine)
    [T_j, H] -> dispatch -> local experts -> combine (dispatch.py) -> [T_j, H]
       | zeros [T, H] with rows chunk j filled in -> all-reduce over tp -> Replicate
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Shard

from raymoe.models.common.shard_hints import NUM_EXPERTS_ATTR
from raymoe.parallel.sharding import chunk_bounds
from raymoe.parallel.styles.base import ExpertRole, ParallelStyle
from raymoe.parallel.styles.dispatch import combine, dispatch
from raymoe.parallel.styles.layouts import all_reduce_backward, all_reduce_forward, local_parameters
from raymoe.parallel.styles.tensor import ShardingStyle

# --- expert weights ----------------------------------------------------------------------------


class GroupedGemmParallel(ShardingStyle):
    """An expert weight ``[E, ...]`` split into ``P`` blocks of whole experts: ``Shard(0)`` over the ep mesh.

    The owning module's ``num_experts`` becomes the local count ``L``, so code that sizes by it
    (``tokens_per_expert`` on local ids, under masking) sees only this rank's experts.
    """

    shards_experts = True

    def placement(self, module: nn.Module, param_name: str, param: Tensor) -> Placement:
        return Shard(0)

    def validate_param(self, module: nn.Module, param_name: str, param: Tensor, mesh_size: int) -> None:
        if param.ndim == 0 or param.shape[0] % mesh_size:
            experts = "a scalar has no expert dim" if param.ndim == 0 else f"its {param.shape[0]} experts (dim 0)"
            raise ValueError(
                f"{param_name} {tuple(param.shape)}: {experts} do not split into {mesh_size} equal blocks of whole "
                "experts [CFG-3]"
            )

    def shard_param(self, module: nn.Module, param_name: str, param: Tensor, mesh: DeviceMesh) -> Tensor:
        sharded = super().shard_param(module, param_name, param, mesh)
        _set_local_expert_count(module, int(param.shape[0]), mesh.size())
        return sharded


def _set_local_expert_count(module: nn.Module, num_experts: int, ep_size: int) -> None:
    """``module.num_experts`` := the local count; a second expert weight of the same module finds it done."""
    current = getattr(module, NUM_EXPERTS_ATTR, None)
    local = num_experts // ep_size
    if current is None or current == local:
        return
    if current != num_experts:
        raise ValueError(
            f"{type(module).__name__}.{NUM_EXPERTS_ATTR}={current} matches neither its expert weight's {num_experts} "
            f"experts nor the local count {local}"
        )
    setattr(module, NUM_EXPERTS_ATTR, local)


# --- masking (EP-2) ----------------------------------------------------------------------------


class EpRouterParallel(ParallelStyle):
    """The router under masked expert parallelism: its ``(ids, weights, logits)`` as this rank's experts see them.

    Ids of this rank's experts become local ids ``[0, L)``; every other pair is masked with the
    negative id ``g - E``, which the experts (``GroupedExperts``) run on local expert ``g mod L``
    (masked pairs spread evenly, shapes stay static) with weight 0. Weights and logits pass
    unchanged. The router itself stays replicated.

    Why a masked id rather than only a zero weight: the experts' backward all-reduces the gradient
    of the routing weights over the mesh (``moe_tp_experts``), so that every rank's replicated router
    gets each pair's gradient from the rank that owns its expert. A pair that a non-owner merely
    weighted by 0 would add that rank's (wrong) expert output to the sum; a masked pair adds
    nothing. Needs ``num_experts % P == 0``.
    """

    expert_role = ExpertRole.ROUTER_MASK

    def validate_param(self, module: nn.Module, param_name: str, param: Tensor, mesh_size: int) -> None:
        num_experts = _router_expert_count(module, param)
        if num_experts % mesh_size:
            raise ValueError(
                f"{param_name} {tuple(param.shape)}: the router's {num_experts} experts do not split into "
                f"{mesh_size} equal blocks [CFG-3]"
            )

    def transform_output_post_forward(self, module: nn.Module, output: Any, mesh: DeviceMesh) -> Any:
        ids_TK, weights_TK, logits_TE = output
        local_ids_TK = mask_foreign_experts(ids_TK, int(logits_TE.shape[-1]), mesh.get_local_rank(), mesh.size())
        return local_ids_TK, weights_TK, logits_TE


def mask_foreign_experts(ids_TK: Tensor, num_experts: int, ep_rank: int, ep_size: int) -> Tensor:
    """Global ids ``[T, K]`` -> local ids of rank ``ep_rank``'s experts, ``id - num_experts`` (< 0) for the others."""
    if num_experts % ep_size:
        raise ValueError(f"ep_router: {num_experts} experts do not split into {ep_size} equal blocks [CFG-3]")
    first = ep_rank * (num_experts // ep_size)
    local_TK = ids_TK - first
    own_TK = (local_TK >= 0) & (local_TK < num_experts // ep_size)
    return local_TK.where(own_TK, ids_TK - num_experts)


def _router_expert_count(module: nn.Module, param: Tensor) -> int:
    count = getattr(module, NUM_EXPERTS_ATTR, None)
    if isinstance(count, int):
        return count
    if param.ndim == 0:
        raise ValueError(f"ep_router needs {type(module).__name__}.{NUM_EXPERTS_ATTR} or a [num_experts, ...] weight")
    return int(param.shape[0])


# --- token dispatch (EP-3 … EP-5) --------------------------------------------------------------


class EpDispatchExpertsParallel(GroupedGemmParallel):
    """The experts module under token dispatch: ``(hidden [T, H], ids [T, K] global, weights [T, K]) -> [T, H]``.

    Replaces the module's forward; the module provides ``compute(x [S, H], counts [L]) -> [S, H]`` over
    rows grouped by local expert (``GroupedExperts.compute``), which runs on the local shards of its
    expert weights (``[L, ...]``; DTensors Shard(0) over ep, which FSDP2's pre-forward hook has
    already gathered over efsdp when it manages them). Its own weights, where no parameter rule
    covers them, are sharded like ``grouped_gemm``.

    ``tp_mesh`` is the rank's tp group (``ctx.mesh("tp")``); None means tp = 1. With tp > 1 the
    inputs are replicated over it and each tp rank dispatches its ``1/tp`` slice of the rows (EP-4).
    One host sync per call, in :func:`raymoe.parallel.styles.dispatch.dispatch` (the split sizes).
    """

    expert_role = ExpertRole.TOKEN_DISPATCH

    def __init__(self, tp_mesh: DeviceMesh | None = None) -> None:
        self.tp_mesh = tp_mesh

    def bind_tp(self, tp_mesh: DeviceMesh) -> EpDispatchExpertsParallel:
        return type(self)(tp_mesh=tp_mesh)

    def install_forward(self, module: nn.Module, mesh: DeviceMesh) -> None:
        _experts_compute(module)  # fail at apply time, not in the first forward

        # Eager inside a compiled block (raymoe.parallel.compiled_blocks): the split sizes are data (a host sync),
        # so are the shapes of every row block after them, and the all-to-alls' autograd runs as torch wrote it.
        # The block's graph breaks here, once each way, and is compiled on both sides.
        @torch.compiler.disable
        def forward(hidden_TH: Tensor, topk_ids_TK: Tensor, topk_weights_TK: Tensor) -> Tensor:
            return self.experts_forward(module, mesh, hidden_TH, topk_ids_TK, topk_weights_TK)

        module.forward = forward

    def experts_forward(
        self, module: nn.Module, ep_mesh: DeviceMesh, hidden_TH: Tensor, ids_TK: Tensor, weights_TK: Tensor
    ) -> Tensor:
        """The replaced forward: this rank's slice of the rows (all of them at tp = 1) through its experts' owners."""
        tp_mesh = self.tp_mesh
        if tp_mesh is None or tp_mesh.size() == 1:
            return routed_experts(module, ep_mesh, hidden_TH, ids_TK, weights_TK)
        hidden_TH, weights_TK = self.replicate_over_tp(hidden_TH, tp_mesh), self.replicate_over_tp(weights_TK, tp_mesh)
        num_tokens = hidden_TH.shape[0]
        start, stop = chunk_bounds(num_tokens, tp_mesh.size(), tp_mesh.get_local_rank())
        mine_TH = routed_experts(module, ep_mesh, hidden_TH[start:stop], ids_TK[start:stop], weights_TK[start:stop])
        # The other tp ranks' rows are zero here: the sum over tp is every row once.
        return all_reduce_forward(F.pad(mine_TH, (0, 0, start, num_tokens - stop)), tp_mesh)

    def replicate_over_tp(self, x: Tensor, tp_mesh: DeviceMesh) -> Tensor:
        """``x`` (Replicate over tp) unchanged; its gradient summed over tp: each tp rank's covers its rows only."""
        return all_reduce_backward(x, tp_mesh)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(tp_mesh={self.tp_mesh})"


def routed_experts(
    module: nn.Module, ep_mesh: DeviceMesh, hidden_TH: Tensor, ids_TK: Tensor, weights_TK: Tensor
) -> Tensor:
    """``[T, H]``: each row's weighted sum over its ``K`` experts, computed by their owners in the ep group."""
    compute = _experts_compute(module)
    with local_parameters(module):
        num_local = local_expert_count(module)
        x_GH, counts_L, meta = dispatch(hidden_TH, ids_TK, num_local * ep_mesh.size(), ep_mesh)
        y_GH: Tensor = compute(x_GH, counts_L)
    return combine(y_GH, weights_TK, meta, ep_mesh).to(hidden_TH.dtype)


def _experts_compute(module: nn.Module) -> Callable[[Tensor, Tensor], Tensor]:
    compute: Callable[[Tensor, Tensor], Tensor] | None = getattr(module, "compute", None)
    if not callable(compute):
        raise ValueError(
            f"ep_dispatch_experts: {type(module).__name__} has no compute(x, counts) over rows grouped by expert"
        )
    return compute


def local_expert_count(module: nn.Module) -> int:
    """``L``: dim 0 of the module's expert weights as this rank holds them (run inside ``local_parameters``)."""
    counts = {int(param.shape[0]) for param in module.parameters(recurse=False) if param.ndim > 0}
    if len(counts) != 1:
        raise ValueError(
            f"ep_dispatch_experts: {type(module).__name__}'s weights must share one local expert count (dim 0), "
            f"got {sorted(counts) or 'no weights'}"
        )
    return counts.pop()
