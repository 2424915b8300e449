"""Low-rank adapters (LoRA) on a model's linear layers and fused expert weights; pure torch, no distribution.

An adapted weight ``W [out, in]`` computes ``x W^T + s * (drop(x) A^T) B^T`` with ``A [r, in]``, ``B [out, r]``
and ``s = alpha / r`` (``alpha / sqrt(r)`` under rsLoRA). ``ΔW = s B A`` is never formed in a forward pass.

Where the factors live (direct parameters of the module that owns ``W``, so a parallel style that covers the
module covers them too, and plan paths stay the base model's)::

    nn.Linear  q_proj.weight [out, in]         q_proj.lora_A [r, in]       q_proj.lora_B [out, r]
    experts    gate_up_proj  [E, 2I, H]        gate_up_proj_lora_A [E, r, H]   gate_up_proj_lora_B [E, 2I, r]
               down_proj     [E, H, I]         down_proj_lora_A    [E, r, I]   down_proj_lora_B    [E, H, r]

Expert adapters are applied on the routed rows inside :meth:`GroupedExperts.compute` as two grouped GEMMs
(``[S, in] -> [S, r] -> [S, out]``), so no ``[E, out, in]`` delta exists in forward or backward.

Each module with adapters says which of its parameters are factors of which base weight
(:data:`~raymoe.models.common.shard_hints.LORA_FACTORS_ATTR`: ``{factor: (base, "A" | "B")}``); the parallel
layer shards a factor like its base along the dimensions they share.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from raymoe.models.common.shard_hints import EXPERT_BATCHED_ATTR, LORA_FACTORS_ATTR, LORA_FROZEN_ATTR

FactorRole = Literal["A", "B"]


@dataclass(frozen=True)
class AdapterShape:
    """One adapter: ``r``, its scale ``s``, and the input dropout probability (linear layers only)."""

    r: int
    scaling: float
    dropout: float = 0.0


@dataclass(frozen=True)
class AdapterTarget:
    """One adapted weight: ``module`` path, ``param`` (None: an ``nn.Linear``'s weight; else a fused expert
    weight of the module) and its shape (r, scale, dropout)."""

    module: str
    param: str | None
    shape: AdapterShape

    @property
    def key(self) -> str:
        """The path PEFT matches patterns against: the module's, or ``module.param``."""
        return f"{self.module}.{self.param}" if self.param is not None else self.module

    def factor_names(self) -> tuple[str, str]:
        """The model's parameter paths of ``(A, B)``."""
        if self.param is None:
            return f"{self.module}.lora_A", f"{self.module}.lora_B"
        return f"{self.module}.{self.param}_lora_A", f"{self.module}.{self.param}_lora_B"


class LoraLinear(nn.Linear):
    """``nn.Linear`` with a low-rank update: ``F.linear(x, W, b) + s * F.linear(F.linear(drop(x), A), B)``.

    A module becomes one by :func:`add_linear_adapter` (its class is swapped; its own parameters stay).
    ``A``/``B`` may be held in another dtype than ``W`` (fp32 adapters on a bf16 base): ``x`` is cast to
    theirs and the update back to the output's.
    """

    lora_A: nn.Parameter
    lora_B: nn.Parameter
    lora_scaling: float
    lora_dropout: float

    def forward(self, x: Tensor) -> Tensor:
        out = F.linear(x, self.weight, self.bias)
        return out + lora_delta(x, self.lora_A, self.lora_B, self.lora_scaling, self.lora_dropout, self.training)


def lora_delta(x: Tensor, a: Tensor, b: Tensor, scaling: float, dropout: float = 0.0, training: bool = False) -> Tensor:
    """``s * (drop(x) A^T) B^T`` for ``x [.., in]``, ``A [r, in]``, ``B [out, r]`` -> ``[.., out]`` in ``x``'s dtype."""
    h = x.to(a.dtype)
    if dropout and training:
        h = F.dropout(h, p=dropout, training=True)
    return (F.linear(F.linear(h, a), b) * scaling).to(x.dtype)


def add_linear_adapter(module: nn.Linear, shape: AdapterShape) -> None:
    """Give ``module`` (an ``nn.Linear``, on any device) factors ``lora_A [r, in]``, ``lora_B [out, r]``."""
    if type(module) is not nn.Linear:
        raise ValueError(f"a LoRA target module must be an nn.Linear, got {type(module).__name__}")
    device, dtype = module.weight.device, module.weight.dtype
    module.lora_A = nn.Parameter(torch.empty(shape.r, module.in_features, device=device, dtype=dtype))
    module.lora_B = nn.Parameter(torch.empty(module.out_features, shape.r, device=device, dtype=dtype))
    module.__class__ = LoraLinear
    setattr(module, "lora_scaling", shape.scaling)  # noqa: B010 (typed on LoraLinear, which it now is)
    setattr(module, "lora_dropout", shape.dropout)  # noqa: B010
    setattr(module, LORA_FACTORS_ATTR, {"lora_A": ("weight", "A"), "lora_B": ("weight", "B")})


def add_expert_adapter(module: nn.Module, param_name: str, shape: AdapterShape) -> None:
    """Factors ``{param_name}_lora_A [E, r, in]`` and ``_lora_B [E, out, r]`` for an expert weight ``[E, out, in]``."""
    weight = module._parameters.get(param_name)
    if weight is None or weight.ndim != 3 or not getattr(module, EXPERT_BATCHED_ATTR, False):
        raise ValueError(f"{param_name} is not a fused expert weight [E, out, in] of {type(module).__name__}")
    if shape.dropout:
        raise ValueError("lora_dropout applies to target_modules only: an expert weight's update cannot drop inputs")
    experts, out_features, in_features = weight.shape
    device, dtype = weight.device, weight.dtype
    a_name, b_name = f"{param_name}_lora_A", f"{param_name}_lora_B"
    a = torch.empty(experts, shape.r, in_features, device=device, dtype=dtype)
    b = torch.empty(experts, out_features, shape.r, device=device, dtype=dtype)
    module.register_parameter(a_name, nn.Parameter(a))
    module.register_parameter(b_name, nn.Parameter(b))
    factors = dict(getattr(module, LORA_FACTORS_ATTR, {}))
    factors.update({a_name: (param_name, "A"), b_name: (param_name, "B")})
    setattr(module, LORA_FACTORS_ATTR, factors)
    scalings = dict(getattr(module, "lora_scalings", {}))
    scalings[param_name] = shape.scaling
    setattr(module, "lora_scalings", scalings)  # noqa: B010 (a plain attribute, not a submodule)


def expert_factors(module: nn.Module, param_name: str) -> tuple[Tensor, Tensor, float] | None:
    """``(A [E, r, in], B [E, out, r], s)`` of the adapter on ``param_name``, or None (read at call time, so a
    parallel style's local shards are what is returned)."""
    scalings: dict[str, float] = getattr(module, "lora_scalings", {})
    if param_name not in scalings:
        return None
    a = module._parameters[f"{param_name}_lora_A"]
    b = module._parameters[f"{param_name}_lora_B"]
    assert a is not None and b is not None
    return a, b, scalings[param_name]


def lora_factors(module: nn.Module) -> dict[str, tuple[str, FactorRole]]:
    """``{factor name: (base parameter name, "A" | "B")}`` of ``module``'s direct parameters."""
    factors: dict[str, tuple[str, FactorRole]] = getattr(module, LORA_FACTORS_ATTR, {})
    return factors


def is_adapter_name(name: str) -> bool:
    """Whether a parameter path names a LoRA factor (``...lora_A``, ``..._lora_B``)."""
    leaf = name.rpartition(".")[2]
    return leaf in ("lora_A", "lora_B") or leaf.endswith(("_lora_A", "_lora_B"))


def adapter_parameters(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """Every factor of ``model`` with its path."""
    for name, param in model.named_parameters():
        if is_adapter_name(name):
            yield name, param


def freeze_base(model: nn.Module) -> None:
    """Only the factors train: every other parameter stops taking gradients. Each module records the direct
    parameters this froze (``LORA_FROZEN_ATTR``; not those frozen anyway, like a router's selection bias, which
    bias balancing moves), so :func:`frozen_base_names` tells the base apart from what a run changes."""
    for module in model.modules():
        frozen = tuple(
            name
            for name, param in module.named_parameters(recurse=False)
            if param.requires_grad and not is_adapter_name(name)
        )
        if frozen:
            setattr(module, LORA_FROZEN_ATTR, (*getattr(module, LORA_FROZEN_ATTR, ()), *frozen))
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter_name(name))


def frozen_base_names(model: nn.Module) -> set[str]:
    """The paths of the parameters :func:`freeze_base` froze (the base's weights under LoRA; empty without it)."""
    return {
        f"{path}.{name}" if path else name
        for path, module in model.named_modules()
        for name in getattr(module, LORA_FROZEN_ATTR, ())
    }


def merged(base: Tensor, a: Tensor, b: Tensor, scaling: float) -> Tensor:
    """``W + s B A`` in ``W``'s dtype: ``[out, in]`` with ``A [r, in]``, ``B [out, r]``, or per expert ``[E, ...]``."""
    delta = torch.matmul(b.float(), a.float()) * scaling
    return (base.float() + delta).to(base.dtype)


def scaling_of(r: int, alpha: float, rslora: bool) -> float:
    """``alpha / r``, or ``alpha / sqrt(r)`` under rank-stabilised LoRA."""
    return alpha / math.sqrt(r) if rslora else alpha / r


def merge_stream(
    tensors: Iterable[tuple[str, Tensor]], targets: Iterable[AdapterTarget]
) -> Iterator[tuple[str, Tensor]]:
    """``tensors`` (path, full tensor) with every adapted base weight replaced by ``W + s B A`` and the factors
    dropped. A base waits for its factors, which its module registers after it."""
    bases = {}
    for target in targets:
        a_name, b_name = target.factor_names()
        bases[f"{target.module}.{target.param or 'weight'}"] = (target, a_name, b_name)
    factor_names = {name for _, a_name, b_name in bases.values() for name in (a_name, b_name)}
    waiting: dict[str, Tensor] = {}
    factors: dict[str, Tensor] = {}
    for name, tensor in tensors:
        if name in bases:
            waiting[name] = tensor
        elif name in factor_names:
            factors[name] = tensor
        else:
            yield name, tensor
        for base_name in [b for b in waiting if bases[b][1] in factors and bases[b][2] in factors]:
            target, a_name, b_name = bases[base_name]
            yield (
                base_name,
                merged(waiting.pop(base_name), factors.pop(a_name), factors.pop(b_name), target.shape.scaling),
            )
    if waiting:
        raise ValueError(f"merging LoRA adapters: no factors reached {sorted(waiting)[:3]}")
