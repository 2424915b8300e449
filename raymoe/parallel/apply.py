"""Apply resolved plan rules on one rank: shard parameters, then wrap forwards (SPEC STYLE-1).

``rules`` is :attr:`raymoe.spec.plans.ResolvedPlans.tp_rules` (over the tp mesh) or ``ep_rules`` (over
the ep mesh): concrete path -> style name, where a path names a module or a parameter, and
``styles`` maps those names to instances (the launch spec's ``plans.styles`` on a rank). Works on a
model built on the meta device (parameters become DTensor placeholders the loader fills, see
:mod:`raymoe.parallel.sharding`) and on one with real weights (each rank cuts its part of the full
tensor it holds)::

    parameters   each gets exactly one style: its own parameter rule, else the rule of the
                 module that directly owns it; validate_param checks them all, then
                 shard_param replaces each (tied parameters stay tied)
    modules      each module rule wraps the module's forward, once:

        install_forward(module, mesh)                 at apply time; may replace module.forward
        forward(*args, **kwargs):
            transform_inputs_pre_forward              args, kwargs -> the layouts the forward needs
            local shards of the direct parameters     only if should_use_local_tensors(module)
                context_around_forward                sees the local parameters
                    the module's forward
            transform_output_post_forward             output -> the layout the next module expects
    shared inputs    a module whose named input consumers are all colwise takes their input boundary
                     once in its own forward (:mod:`raymoe.parallel.input_boundary`)

The wrapper lives on the instance (``module.forward``), so it runs inside ``module.__call__``,
after any forward pre-hooks (FSDP2 unsharding), and reads the parameters at call time, so a
loader may replace the placeholders after this.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from raymoe.models.common.lora import lora_factors
from raymoe.parallel.input_boundary import share_input_boundaries
from raymoe.parallel.styles import ParallelStyle, builtin_styles, check_style_name
from raymoe.parallel.styles.layouts import local_parameters

# Set on a module whose forward carries a style's hooks, so a second application fails loudly.
_APPLIED_STYLE_ATTR = "_raymoe_tp_style"


@dataclass(frozen=True)
class _ParamTarget:
    path: str
    module: nn.Module
    name: str
    style_name: str


def apply_rules(
    model: nn.Module,
    rules: Mapping[str, str],
    mesh: DeviceMesh,
    styles: Mapping[str, ParallelStyle] | None = None,
) -> None:
    """Shard ``model``'s parameters and install the styles' forward hooks on this rank, over the 1-D ``mesh``.

    ``styles`` (default: fresh built-in instances) maps each style name of ``rules`` to its instance.
    """
    if mesh.ndim != 1:
        raise ValueError(f"apply_rules needs a 1-D mesh (e.g. mesh['tp']), got a {mesh.ndim}-D mesh {mesh}")
    lookup = _StyleLookup(styles if styles is not None else builtin_styles())
    module_rules, param_rules = _split_rules(model, rules)
    targets = _param_targets(module_rules, param_rules)
    for target in targets:  # all checked before any is sharded, so a bad rule leaves the model untouched
        _validate(target, lookup(target.style_name), mesh.size())
    done: dict[int, Tensor] = {}
    for target in targets:
        _shard(target, lookup(target.style_name), mesh, done)
    for path, (module, style_name) in module_rules.items():
        _wrap_forward(path, module, lookup(style_name), mesh)
    share_input_boundaries(model, [(module, lookup(name)) for module, name in module_rules.values()], mesh)


@dataclass(frozen=True)
class _StyleLookup:
    styles: Mapping[str, ParallelStyle]

    def __call__(self, name: str) -> ParallelStyle:
        check_style_name(self.styles, name)
        return self.styles[name]


def _split_rules(
    model: nn.Module, rules: Mapping[str, str]
) -> tuple[dict[str, tuple[nn.Module, str]], dict[str, _ParamTarget]]:
    """Module rules (path -> (module, style)) and parameter rules (path -> target)."""
    module_rules: dict[str, tuple[nn.Module, str]] = {}
    param_rules: dict[str, _ParamTarget] = {}
    for path, style_name in rules.items():
        owner_path, _, leaf = path.rpartition(".")
        owner = _submodule(model, owner_path, path)
        if leaf in owner._parameters:
            param_rules[path] = _ParamTarget(path, owner, leaf, style_name)
        else:
            module_rules[path] = (_submodule(model, path, path), style_name)
    return module_rules, param_rules


def _submodule(model: nn.Module, path: str, rule: str) -> nn.Module:
    try:
        return model.get_submodule(path)
    except AttributeError:
        raise ValueError(f"rule {rule!r} names no module or parameter of {type(model).__name__}") from None


def _param_targets(
    module_rules: Mapping[str, tuple[nn.Module, str]], param_rules: Mapping[str, _ParamTarget]
) -> list[_ParamTarget]:
    """Every parameter with a rule, once: its own rule wins over its module's, and a LoRA factor follows the rule
    of its base weight (:mod:`raymoe.parallel.adapters`)."""
    targets = dict(param_rules)
    for target in param_rules.values():
        owner_path = target.path.rpartition(".")[0]
        for factor, (base_name, _) in lora_factors(target.module).items():
            if base_name == target.name:
                path = f"{owner_path}.{factor}" if owner_path else factor
                targets[path] = _ParamTarget(path, target.module, factor, target.style_name)
    for path, (module, style_name) in module_rules.items():
        for name, param in module._parameters.items():
            param_path = f"{path}.{name}" if path else name
            if param is not None and param_path not in targets:
                targets[param_path] = _ParamTarget(param_path, module, name, style_name)
    return list(targets.values())


def _validate(target: _ParamTarget, style: ParallelStyle, mesh_size: int) -> None:
    """The driver already ran validate_param (plans.resolve_plans); again here for rules applied without it."""
    param = target.module._parameters[target.name]
    assert param is not None  # targets only name present parameters
    try:
        style.validate_param(target.module, target.name, param, mesh_size)
    except ValueError as exc:
        raise ValueError(f"rule {target.path!r} -> {target.style_name!r}: {exc}") from None


def _shard(target: _ParamTarget, style: ParallelStyle, mesh: DeviceMesh, done: dict[int, Tensor]) -> None:
    """Replace the target parameter by ``style.shard_param``'s result.

    ``done`` maps each original parameter (by id) to what replaced it, so parameters tied across
    modules (an embedding and an lm_head sharing one weight) stay one parameter.
    """
    param = target.module._parameters[target.name]
    assert param is not None  # targets only name present parameters
    if isinstance(param, DTensor):
        raise ValueError(f"{target.path} is already a DTensor ({param.placements}); rules are applied once per model")
    sharded = style.shard_param(target.module, target.name, param, mesh)
    previous = done.setdefault(id(param), sharded)
    if _placements(previous) != _placements(sharded):
        raise ValueError(
            f"{target.path} is tied to a parameter already sharded as {_placements(previous)}, but its rule "
            f"{target.style_name!r} shards it as {_placements(sharded)}; tied parameters need one layout"
        )
    if previous is not param:
        target.module._parameters[target.name] = _as_parameter(previous, param)


def _placements(tensor: Tensor) -> tuple[Any, ...]:
    return tuple(tensor.placements) if isinstance(tensor, DTensor) else ()


def _as_parameter(tensor: Tensor, original: Tensor) -> nn.Parameter:
    if isinstance(tensor, nn.Parameter):
        return tensor
    return nn.Parameter(tensor, requires_grad=original.requires_grad)


def applied_style(module: nn.Module) -> ParallelStyle | None:
    """The style whose hooks wrap ``module``'s forward, or None."""
    style = getattr(module, _APPLIED_STYLE_ATTR, None)
    return style if isinstance(style, ParallelStyle) else None


def _wrap_forward(path: str, module: nn.Module, style: ParallelStyle, mesh: DeviceMesh) -> None:
    if hasattr(module, _APPLIED_STYLE_ATTR):
        raise ValueError(f"{path or 'the model'} already runs {getattr(module, _APPLIED_STYLE_ATTR)!r}")
    style.install_forward(module, mesh)
    inner = module.forward

    @functools.wraps(inner)
    def forward(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = style.transform_inputs_pre_forward(module, args, kwargs, mesh)
        local = local_parameters(module) if style.should_use_local_tensors(module) else nullcontext()
        with local, style.context_around_forward(module, mesh):
            output = inner(*args, **kwargs)
        return style.transform_output_post_forward(module, output, mesh)

    module.forward = forward
    setattr(module, _APPLIED_STYLE_ATTR, style)
