"""What a policy-gradient ``train_step`` optimizes (RL): the loss kind, its clip and KL settings, and how the
per-token values of the global batch are summed into one number. Checked on the driver, sent to the ranks.

    loss="cross_entropy"        the default, not a policy loss (no PolicyLoss)
    loss="importance_sampling"  -ratio * A                                needs advantages, old_logprobs
    loss="ppo"                  clipped surrogate (clip_low, clip_high, dual clip clip_c)    the same
    loss=callable               fn(logprobs [b, S], fields) -> (loss_sum, normalizer_contribution)
    kl_coef > 0                 + kl_coef * k3(logprobs, ref_logprobs)      needs ref_logprobs

    loss_aggregation   weight of a loss token          normalizer (over the whole global batch)
    "token-mean"       1                               loss tokens
    "sequence-mean"    1 / the loss tokens of its row   rows with a loss token   (GRPO's original)
    "token-sum-norm"   1                               rows * max_new_tokens    (Dr. GRPO)

A callable's ``loss_sum`` is back-propagated as it is and its ``normalizer_contribution`` (a number, or a
0-d tensor without a graph) summed over every micro-batch and data-parallel batch of the step; the
accumulated gradients are then divided by that sum before clipping and AdamW, so the step is that of
``sum(loss_sum) / sum(normalizer)`` over the global batch whatever the layout or accumulation.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from torch import Tensor

LOSS_KINDS = ("cross_entropy", "importance_sampling", "ppo")
AGGREGATIONS = ("token-mean", "sequence-mean", "token-sum-norm")
TOKEN_FIELDS = ("advantages", "old_logprobs", "ref_logprobs")

PolicyLossFn = Callable[[Tensor, Mapping[str, Tensor]], tuple[Tensor, Any]]


@dataclass(frozen=True)
class PolicyLoss:
    """A checked policy loss (see the module docstring); ``kind`` is ``"importance_sampling"``, ``"ppo"`` or
    ``"callable"`` (``fn`` set). ``clip_high`` None means ``clip_low`` (the symmetric clip)."""

    kind: str
    fn: PolicyLossFn | None = None
    clip_low: float = 0.2
    clip_high: float | None = None
    clip_c: float | None = None
    kl_coef: float = 0.0
    loss_aggregation: str = "token-mean"
    max_new_tokens: int | None = None
    temperature: float = 1.0

    @property
    def upper_clip(self) -> float:
        return self.clip_low if self.clip_high is None else self.clip_high

    @property
    def is_callable(self) -> bool:
        return self.fn is not None

    def required_fields(self) -> tuple[str, ...]:
        """The per-token inputs this loss reads (a callable reads what it wants: none required)."""
        if self.is_callable:
            return ()
        return ("advantages", "old_logprobs") + (("ref_logprobs",) if self.kl_coef > 0 else ())


def policy_loss(loss: object, options: Mapping[str, Any]) -> PolicyLoss | None:
    """``train_step``'s ``loss`` and policy options, checked: None for cross-entropy, else a :class:`PolicyLoss`.

    Every problem is one ``ValueError`` naming the option, the value and the rule."""
    known = [f.name for f in fields(PolicyLoss) if f.name not in ("kind", "fn")]
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ValueError(f"train_step: unknown option(s) {', '.join(unknown)}; the policy-loss options are {known}")
    if callable(loss):
        extra = sorted(set(options) - {"temperature"})
        if extra:
            raise ValueError(
                f"train_step: loss=callable takes only temperature; {', '.join(extra)} belong to the built-in losses "
                "(a callable returns its own loss_sum and normalizer)"
            )
        return _checked(PolicyLoss("callable", loss, **options))
    if loss not in LOSS_KINDS:
        raise ValueError(f"train_step: loss={loss!r}: choose one of {', '.join(LOSS_KINDS)} or a callable")
    if loss == "cross_entropy":
        if options:
            raise ValueError(
                f"train_step: {', '.join(sorted(options))} apply to policy losses; loss='cross_entropy' takes none"
            )
        return None
    return _checked(PolicyLoss(str(loss), **options))


def _checked(policy: PolicyLoss) -> PolicyLoss:
    _number("temperature", policy.temperature, low=0.0)
    if policy.is_callable:
        return policy
    _number("clip_low", policy.clip_low, low=0.0, high=1.0)
    if policy.clip_high is not None:
        _number("clip_high", policy.clip_high, low=0.0)
    if policy.clip_c is not None:
        _number("clip_c", policy.clip_c, low=1.0)
        if policy.kind != "ppo":
            raise ValueError(f"train_step: clip_c={policy.clip_c} (dual clip) applies to loss='ppo' only")
    if policy.kind != "ppo" and (policy.clip_high is not None or policy.clip_low != PolicyLoss.clip_low):
        raise ValueError(f"train_step: clip_low / clip_high apply to loss='ppo', not loss={policy.kind!r}")
    _number("kl_coef", policy.kl_coef, low=0.0, inclusive=True)
    if policy.loss_aggregation not in AGGREGATIONS:
        raise ValueError(
            f"train_step: loss_aggregation={policy.loss_aggregation!r}: choose one of {', '.join(AGGREGATIONS)}"
        )
    width = policy.max_new_tokens
    if policy.loss_aggregation == "token-sum-norm":
        if isinstance(width, bool) or not isinstance(width, int) or width < 1:
            raise ValueError(
                f"train_step: loss_aggregation='token-sum-norm' divides by rows * max_new_tokens: give max_new_tokens "
                f"as an int >= 1 (the rollouts' generation limit), got {width!r}"
            )
    elif width is not None:
        raise ValueError("train_step: max_new_tokens is the constant of loss_aggregation='token-sum-norm' only")
    return policy


def _number(name: str, value: object, *, low: float, high: float | None = None, inclusive: bool = False) -> None:
    """A finite float > ``low`` (>= with ``inclusive``) and < ``high``, or a ``ValueError`` naming ``name``."""
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        number = float(value)  # type: ignore[arg-type]
        ok = (number >= low if inclusive else number > low) and (high is None or number < high)
    if not ok:
        bounds = f"{'>=' if inclusive else '>'} {low}" + (f" and < {high}" if high is not None else "")
        raise ValueError(f"train_step: {name}={value!r} must be a finite number {bounds}")
