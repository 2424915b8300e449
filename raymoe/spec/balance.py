"""Load-balancing settings of a run (SPEC LB-2): which methods, with which strengths; checked on the driver.

    method     what it turns on
    auto       the checkpoint's convention: the auxiliary loss iff config.json has output_router_logits
    aux        the auxiliary loss as transformers computes it, statistics pooled over all MoE layers
               (coefficient: router_aux_loss_coef, else the checkpoint's)
    layer_aux  the auxiliary loss per layer, then averaged (Megatron, GShard): it sees a layer's imbalance
               that pooling hides (raymoe.models.moe.balance)
    bias       DeepSeek-V3 bias balancing (needs a router with e_score_correction_bias); no aux loss
    none       none of them
    aux,bias   an aux loss (either scope) and bias balancing

``capacity_factor`` (token dropping, independent of the method) and ``bias_update_rate`` complete
it; ``telemetry`` (on by default) records every router's choices for the step's load metrics, and
is on whenever a method needs the records. :meth:`BalanceOptions.resolve` turns the options into
the concrete :class:`BalanceConfig` the ranks apply, against the model's config.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from raymoe.models.common.config import ModelConfig

BALANCE_METHODS = ("auto", "aux", "layer_aux", "bias", "none")
_AUX = ("aux", "layer_aux")
DEFAULT_BIAS_UPDATE_RATE = 1e-3


@dataclass(frozen=True)
class BalanceConfig:
    """What the ranks do: the aux-loss coefficient (0: off), the bias update rate (None: off), the capacity
    factor (None: no dropping), and whether routers record their choices (telemetry, aux loss, bias)."""

    aux_loss_coef: float = 0.0
    aux_loss_per_layer: bool = False
    bias_update_rate: float | None = None
    capacity_factor: float | None = None
    record_routing: bool = True


@dataclass(frozen=True)
class BalanceOptions:
    """What the user asked for; every field is checked when it is built (``ValueError`` naming it)."""

    balance: str = "auto"
    router_aux_loss_coef: float | None = None
    bias_update_rate: float = DEFAULT_BIAS_UPDATE_RATE
    capacity_factor: float | None = None
    telemetry: bool = True

    def __post_init__(self) -> None:
        methods = self.methods()
        unknown = [m for m in methods if m not in BALANCE_METHODS]
        combined = len(methods) == 2 and "bias" in methods and any(m in _AUX for m in methods)
        if unknown or not methods or (len(methods) > 1 and not combined):
            raise ValueError(
                f"balance={self.balance!r}: choose one of {', '.join(BALANCE_METHODS)}, or an aux loss with bias "
                "('aux,bias' or 'layer_aux,bias')"
            )
        _check_number("router_aux_loss_coef", self.router_aux_loss_coef, minimum=0.0, optional=True)
        _check_number("bias_update_rate", self.bias_update_rate, minimum=0.0, strict=True)
        _check_number("capacity_factor", self.capacity_factor, minimum=0.0, optional=True, strict=True)
        if not isinstance(self.telemetry, bool):
            raise ValueError(f"balance: telemetry={self.telemetry!r} must be True or False")

    def methods(self) -> list[str]:
        if not isinstance(self.balance, str):
            return []
        return [part.strip() for part in self.balance.split(",") if part.strip()]

    def resolve(self, config: ModelConfig) -> BalanceConfig:
        """The concrete settings for a model of ``config``; ``ValueError`` where the model cannot do them."""
        methods = self.methods()
        if config.moe is None:
            if methods not in (["auto"], ["none"]) or self.capacity_factor is not None:
                raise ValueError(
                    f"balance={self.balance!r}, capacity_factor={self.capacity_factor!r}: {config.model_type} is a "
                    "dense model (no routers to balance)"
                )
            return BalanceConfig(record_routing=False)
        if "bias" in methods and not config.moe.selection_bias:
            raise ValueError(
                f"balance={self.balance!r} needs a router with a per-expert selection bias (e_score_correction_bias: "
                f"DeepSeek-V3, GLM-4.5); {config.model_type} has none, so a checkpoint exported from this run "
                "could not reproduce the routing it was trained with. Use balance='aux' or 'layer_aux' instead"
            )
        given = self.router_aux_loss_coef
        if methods == ["auto"]:  # the checkpoint's convention; a coefficient for the run also turns it on
            aux_on = config.moe.output_router_logits or given is not None
        else:
            aux_on = any(m in _AUX for m in methods)
        coef = given if given is not None else config.moe.router_aux_loss_coef
        aux_loss_coef = coef if aux_on else 0.0
        bias_update_rate = self.bias_update_rate if "bias" in methods else None
        return BalanceConfig(
            aux_loss_coef=aux_loss_coef,
            aux_loss_per_layer="layer_aux" in methods,
            bias_update_rate=bias_update_rate,
            capacity_factor=self.capacity_factor,
            record_routing=self.telemetry or aux_loss_coef > 0 or bias_update_rate is not None,
        )


def _check_number(field: str, value: object, *, minimum: float, optional: bool = False, strict: bool = False) -> None:
    if value is None and optional:
        return
    bad = (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or (value <= minimum if strict else value < minimum)
    )
    if bad:
        rule = f"> {minimum:g}" if strict else f">= {minimum:g}"
        raise ValueError(f"balance: {field}={value!r} must be a number {rule}" + (" or None" if optional else ""))
