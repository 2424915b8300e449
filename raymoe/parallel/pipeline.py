"""The plans of one pipeline stage: the resolved rules restricted to the modules its model part holds.

Plans are resolved once, on the driver, for the whole model (``raymoe.spec.plans``): rules name concrete
paths (``model.layers.5.mlp.experts``). A stage's part (:meth:`~raymoe.models.common.decoder.CausalLM.keep_part`)
keeps the names of what it holds, so its plans are the rules whose path it still has; the stage is then
sharded (TP, EP, FSDP2) exactly as a whole model is.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from torch import nn


def rules_held(rules: Mapping[str, str], part: nn.Module) -> dict[str, str]:
    """The rules (concrete path -> style) whose module or parameter ``part`` holds."""
    return {path: style for path, style in rules.items() if holds(part, path)}


def paths_held(paths: Iterable[str], part: nn.Module) -> tuple[str, ...]:
    return tuple(path for path in paths if holds(part, path))


def holds(part: nn.Module, path: str) -> bool:
    """True when ``path`` names a module or a parameter of ``part``."""
    owner, _, name = path.rpartition(".")
    try:
        module = part.get_submodule(path)
    except AttributeError:
        try:
            module = part.get_submodule(owner)
        except AttributeError:
            return False
        return name in dict(module.named_parameters(recurse=False))
    return module is not None
