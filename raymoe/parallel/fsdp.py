"""FSDP2 on a rank: dense modules over the data-parallel axes, experts over their own (SPEC TRAIN-1, TOPO-5, EP-6).

Applied after the TP and EP rules (torchtitan's order: TP/EP -> FSDP2), with
``torch.distributed.fsdp.fully_shard``::

    float32 modules   fully_shard over (dp_replicate, fsdp)    routers holding a float32 selection bias: their
                                                               own unit, computing in float32 (raymoe.spec.precision)
    experts (EP on)   fully_shard over (dp_replicate, efsdp)   params: Shard(0) over ep, then over efsdp
    fsdp_plan rules   fully_shard over (dp_replicate, fsdp)    dense params, 2-D with TP DTensors;
                                                               one unit per rule, except that the single
                                                               keep_full_weight modules (norm, head) share one
    the model         fully_shard over (dp_replicate, fsdp)    whatever no rule took (root), and the modules of
                                                               rules whose weight is tied to one outside them (a
                                                               head tied to the embedding: one unit per parameter)

A 2-D data-parallel mesh is HSDP: reduce-scatter inside a replica, all-reduce across replicas.

Gradients are *summed* over every data-parallel axis, never averaged: each rank's loss is its
token-loss sum divided by the global batch's token count (raymoe.rank.train), so the sum is one
process's gradient for dense modules and experts alike, whatever the layout. Sum-only
collectives also run on gloo, which has no AVG / PREMUL_SUM.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from weakref import WeakKeyDictionary

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo
from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

from raymoe.models.common.decoder import CausalLM
from raymoe.parallel.reduce_scatter import AllToAllReduceScatter

RESHARD_AFTER_FORWARD = {"free_full_weight": True, "keep_full_weight": False}


@dataclass(frozen=True)
class FsdpUnits:
    """What to wrap, and over which meshes (FSDP2's data-parallel meshes: ``(dp_replicate, fsdp)`` and
    ``(dp_replicate, efsdp)`` under HSDP, the shard axis alone otherwise).

    ``expert_modules`` hold expert weights (empty without EP); ``fsdp_rules`` are concrete module
    paths -> strategy (also without data parallelism, where the units only cast or hold experts: a step gathers
    one unit at a time).
    """

    dense_mesh: DeviceMesh
    expert_mesh: DeviceMesh
    expert_modules: Sequence[str]
    fsdp_rules: Mapping[str, str]
    float32_modules: Sequence[str] = ()
    compute_dtype: torch.dtype | None = None
    cpu_offload: bool = False
    # gloo on CPU: gradients reduce-scatter as one all-to-all and a local sum (raymoe.parallel.reduce_scatter)
    reduce_scatter_by_all_to_all: bool = False


def apply_fsdp(model: nn.Module, units: FsdpUnits, device: torch.device) -> None:
    """Wrap ``model`` (TP/EP rules already applied, still on meta) in FSDP2 units.

    ``compute_dtype`` (a mixed precision policy, :mod:`raymoe.spec.precision`): parameters are gathered in it for
    forward and backward, gradients reduced in float32 into the master dtype the parameters are held in. The
    ``float32_modules`` (routers with a float32 selection bias) are units of their own that compute in float32.
    """
    mp_policy, offload_policy = mixed_precision(units.compute_dtype), offload(units.cpu_offload, device)

    def shard(module: nn.Module, mesh: DeviceMesh, reshard_after_forward: bool = True) -> None:
        fully_shard(
            module,
            mesh=mesh,
            reshard_after_forward=reshard_after_forward,
            mp_policy=mp_policy,
            offload_policy=offload_policy,
        )

    dense_mesh = units.dense_mesh
    for path in units.float32_modules:
        fully_shard(
            model.get_submodule(path),
            mesh=dense_mesh,
            # inputs stay in the compute dtype: the router casts what it needs itself, as without FSDP
            mp_policy=MixedPrecisionPolicy(torch.float32, torch.float32, cast_forward_inputs=False),
            offload_policy=offload_policy,
        )
    for path in units.expert_modules:
        shard(model.get_submodule(path), units.expert_mesh)
    rules = {path: strategy for path, strategy in units.fsdp_rules.items() if not _tied_outside(model, path)}
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
    reduce_scatter = AllToAllReduceScatter() if units.reduce_scatter_by_all_to_all else None
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
            if reduce_scatter is not None:
                module.set_custom_reduce_scatter(reduce_scatter)


def gathered_bytes(model: nn.Module) -> int:
    """Bytes of every FSDP2 unit's gathered parameters in ``model``, in the dtype each computes in: what this rank holds
    at a step's peak when every unit keeps its gathered weights until backward."""
    total = 0
    for _, state in _units(model):
        casts_to = state._mp_policy.param_dtype
        for group in _param_groups(state):
            for param in group.fsdp_params:
                held = param.sharded_param.dtype
                dtype = casts_to if casts_to is not None and held.is_floating_point else held
                total += param._orig_size.numel() * dtype.itemsize
    return total


def keep_gathered_after_forward(model: CausalLM, every_unit: bool, last_layer: bool) -> None:
    """Units of ``model`` (FSDP2 applied) that keep their gathered weights from forward until their backward
    (:mod:`raymoe.spec.reshard`): ``every_unit``, or else, with ``last_layer``, the last decoder layer it runs (with the
    units inside it: its experts, a float32 router), whose backward comes first. The others keep their own setting."""
    if every_unit:
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_reshard_after_forward(False, recurse=False)
        return
    kept = model.kept_layers()
    if last_layer and kept:
        layer = model.model.layers[kept[-1]]
        if isinstance(layer, FSDPModule):
            layer.set_reshard_after_forward(False, recurse=True)


def _units(model: nn.Module) -> list[tuple[FSDPModule, FSDPState]]:
    """Each FSDP2 unit of ``model`` once, by its first module (a unit over several modules, the norm and head, is one)
    and its state."""
    units: list[tuple[FSDPModule, FSDPState]] = []
    for module in model.modules():
        if isinstance(module, FSDPModule):
            state = module._get_fsdp_state()
            if not any(state is other for _, other in units):
                units.append((module, state))
    return units


def _param_groups(state: FSDPState) -> list[FSDPParamGroup]:
    """One FSDP2 unit's parameter groups: a list since torch 2.13 (``_fsdp_param_groups``), before it one optional
    group (``_fsdp_param_group``; the GPU image of the device machine has torch 2.11)."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = state._fsdp_param_group
    return [] if group is None else [group]


def mixed_precision(compute_dtype: torch.dtype | None) -> MixedPrecisionPolicy:
    """Parameters cast to ``compute_dtype`` for forward/backward, gradients reduced in float32 (None: as held)."""
    if compute_dtype is not None:
        return MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def offload(enabled: bool, device: torch.device) -> OffloadPolicy:
    """``fsdp_cpu_offload``: sharded parameters, gradients and optimizer state live on the CPU."""
    if enabled:
        return CPUOffloadPolicy(pin_memory=device.type == "cuda")
    return OffloadPolicy()


def _tied_outside(model: nn.Module, path: str) -> bool:
    """Whether a parameter of module ``path`` is also one of a module outside it (a tied head): FSDP2 manages a
    parameter in one unit only, so the root takes it."""
    own = {id(param) for param in model.get_submodule(path).parameters()}
    inside = f"{path}."
    return any(
        id(param) in own and not name.startswith(inside)
        for name, param in model.named_parameters(remove_duplicate=False)
    )


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


def keep_unsharded(model: nn.Module) -> None:
    """Gather every FSDP unit of ``model`` now and keep its full weights through every later forward.

    For decoding: one all-gather per unit for a whole generation instead of one per unit and token (FSDP2
    reshards after each forward by default). The full model then stays on the device until
    :func:`release_unsharded`, which reshards it and gives each unit back its own reshard-after-forward
    setting. A second call before the release does nothing.
    """
    if model in _KEPT:
        return
    if isinstance(model, FSDPModule):
        # The root decides its own setting at its first forward; decide it now, so the one restored is final.
        model._get_fsdp_state()._lazy_init()
    kept: list[_KeptUnit] = []
    for module, state in _units(model):
        groups = [(group, group.post_forward_mesh_info) for group in _param_groups(state)]
        kept.append((state, state._auto_reshard_after_forward, groups))
        module.set_reshard_after_forward(False, recurse=False)
        module.unshard()
    _KEPT[model] = kept


def release_unsharded(model: nn.Module) -> None:
    """End :func:`keep_unsharded`: every unit's reshard-after-forward setting as before, every unit resharded.
    Nothing to end: only the reshard."""
    for state, auto, groups in _KEPT.pop(model, []):
        state._auto_reshard_after_forward = auto
        for group, post_forward in groups:
            group.post_forward_mesh_info = post_forward
    reshard(model)


# A unit keep_unsharded holds gathered: its state, and its own settings (the root's automatic choice; the
# mesh each parameter group reshards to after forward, None: it keeps the full weights).
_KeptUnit = tuple[FSDPState, bool | None, list[tuple[FSDPParamGroup, FSDPMeshInfo | None]]]
_KEPT: WeakKeyDictionary[nn.Module, list[_KeptUnit]] = WeakKeyDictionary()
