"""FSDP2 on a rank: dense modules over the data-parallel axes, experts over their own (SPEC TRAIN-1, TOPO-5, EP-6).

Applied after the TP and EP rules (torchtitan's order: TP/EP -> FSDP2), with
``torch.distributed.fsdp.fully_shard``::

    experts (EP on)   fully_shard over (dp_replicate, efsdp)   params: Shard(0) over ep, then over efsdp
    fsdp_plan rules   fully_shard over (dp_replicate, fsdp)    dense params, 2-D with TP DTensors;
                                                               one unit per rule, except that the single
                                                               keep_full_weight modules (norm, head) share one
    the model         fully_shard over (dp_replicate, fsdp)    whatever no rule took (root)

A 2-D data-parallel mesh is HSDP: reduce-scatter inside a replica, all-reduce across replicas.

Gradients are *summed* over every data-parallel axis, never averaged: each rank's loss is its
token-loss sum divided by the global batch's token count (raymoe.rank.train), so the sum is one
process's gradient for dense modules and experts alike, whatever the layout. Sum-only
collectives also run on gloo, which has no AVG / PREMUL_SUM.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

RESHARD_AFTER_FORWARD = {"free_full_weight": True, "keep_full_weight": False}


@dataclass(frozen=True)
class FsdpUnits:
    """What to wrap, and over which meshes (FSDP2's data-parallel meshes: ``(dp_replicate, fsdp)`` and
    ``(dp_replicate, efsdp)`` under HSDP, the shard axis alone otherwise).

    ``expert_modules`` hold expert weights (empty without EP); ``fsdp_rules`` are concrete module
    paths -> strategy (empty without data parallelism: the root unit alone carries the policies).
    """

    dense_mesh: DeviceMesh
    expert_mesh: DeviceMesh
    expert_modules: Sequence[str]
    fsdp_rules: Mapping[str, str]
    mixed_precision: bool = False
    cpu_offload: bool = False


def apply_fsdp(model: nn.Module, units: FsdpUnits, device: torch.device) -> None:
    """Wrap ``model`` (TP/EP rules already applied, still on meta) in FSDP2 units."""
    mp_policy, offload_policy = mixed_precision(units.mixed_precision), offload(units.cpu_offload, device)

    def shard(module: nn.Module, mesh: DeviceMesh, reshard_after_forward: bool = True) -> None:
        fully_shard(
            module,
            mesh=mesh,
            reshard_after_forward=reshard_after_forward,
            mp_policy=mp_policy,
            offload_policy=offload_policy,
        )

    dense_mesh = units.dense_mesh
    for path in units.expert_modules:
        shard(model.get_submodule(path), units.expert_mesh)
    rules = dict(units.fsdp_rules)
    tail = _keep_group(model, rules)
    for path, strategy in _children_first(rules):
        if path not in tail:
            shard(model.get_submodule(path), dense_mesh, RESHARD_AFTER_FORWARD[strategy])
    if tail:
        # The single modules that keep their gathered weights (the final norm and the head) form
        # one unit: one all-gather in forward, none in backward, one reduce-scatter.
        fully_shard(
            [model.get_submodule(path) for path in tail],
            mesh=dense_mesh,
            reshard_after_forward=False,
            mp_policy=mp_policy,
            offload_policy=offload_policy,
        )
    shard(model, dense_mesh)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


def mixed_precision(enabled: bool) -> MixedPrecisionPolicy:
    """``fsdp_mixed_precision``: bf16 parameters in forward/backward, fp32 gradient reduction."""
    if enabled:
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def offload(enabled: bool, device: torch.device) -> OffloadPolicy:
    """``fsdp_cpu_offload``: sharded parameters, gradients and optimizer state live on the CPU."""
    if enabled:
        return CPUOffloadPolicy(pin_memory=device.type == "cuda")
    return OffloadPolicy()


def _keep_group(model: nn.Module, rules: dict[str, str]) -> list[str]:
    """``keep_full_weight`` rules that can share one FSDP unit: single modules (not blocks of a
    ``ModuleList``, whose own units let backward reduce-scatter each block as soon as it is done)
    not nested in the module of another rule (that unit already holds their parameters)."""
    return [
        path
        for path, strategy in rules.items()
        if not RESHARD_AFTER_FORWARD[strategy]
        and not isinstance(model.get_submodule(path.rpartition(".")[0]), nn.ModuleList)
        and not any(path.startswith(f"{other}.") for other in rules)
    ]


def _children_first(rules: dict[str, str]) -> Iterable[tuple[str, str]]:
    """Nested FSDP units must be wrapped before the units that contain them."""
    return sorted(rules.items(), key=lambda item: -item[0].count("."))


def reshard(model: nn.Module) -> None:
    """Free the full weights every FSDP unit still holds after a forward without backward.

    Units with ``keep_full_weight`` stay unsharded after a no-grad forward (inference); a later
    training forward would then run on those gathered copies, whose gradients FSDP no longer
    reduces, and an optimizer step would leave them stale. Inference ends by calling this.
    """
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
