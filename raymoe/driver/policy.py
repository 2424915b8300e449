"""A policy-gradient step's inputs on the driver (RL): per-token fields checked, the aggregation as weights.

``advantages``, ``old_logprobs``, ``ref_logprobs`` and ``loss_mask`` are ``[B, S]`` aligned with ``input_ids``
(entry ``t`` belongs to token ``t``, as :meth:`logprobs` answers). A token takes loss where ``loss_mask`` says
(default: every token a distribution predicted, as the labels allow) and the loss's aggregation
(:mod:`raymoe.spec.policy`) becomes each token's weight and one normalizer over the whole global batch,
computed here, so every micro-batch of every data-parallel batch divides by the same number::

    token-mean      w = 1                 N = loss tokens
    sequence-mean   w = 1 / row's tokens  N = rows with a loss token
    token-sum-norm  w = 1                 N = rows * max_new_tokens
    callable        w = 1 (the mask)      N = sum of what the callable returns, on the ranks
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from raymoe.driver.batch import GlobalBatch
from raymoe.driver.logprobs import predicted_positions
from raymoe.models.common.loss import IGNORE_INDEX
from raymoe.rank.contract import StepResult
from raymoe.spec.policy import TOKEN_FIELDS, PolicyLoss, policy_loss


@dataclass(frozen=True)
class PolicyStep:
    """A checked policy step: the loss, per-token ``fields`` (``weights`` and the given inputs, ``[B, S]``
    float32), the global ``normalizer`` (1 for a callable: the ranks sum theirs) and the loss tokens."""

    policy: PolicyLoss
    fields: dict[str, Tensor]
    normalizer: float
    num_loss_tokens: int


def prepare_policy(
    batch: GlobalBatch,
    loss: object,
    options: dict[str, Any],
    given: Mapping[str, object | None],
    loss_mask: object | None,
) -> PolicyStep | None:
    """``train_step``'s loss arguments checked: None for cross-entropy (which takes no per-token inputs)."""
    policy = policy_loss(loss, options)
    if policy is None:
        passed = sorted(name for name, value in {**given, "loss_mask": loss_mask}.items() if value is not None)
        if passed:
            raise ValueError(
                f"train_step: {', '.join(passed)} are inputs of a policy loss; loss='cross_entropy' takes labels "
                "(-100: no loss). Pass loss='ppo', 'importance_sampling' or a callable"
            )
        return None
    return policy_step(batch, policy, given, loss_mask)


def policy_step(
    batch: GlobalBatch, policy: PolicyLoss, given: Mapping[str, object | None], loss_mask: object | None
) -> PolicyStep:
    """Check ``given`` (``advantages``, ``old_logprobs``, ``ref_logprobs``: None when not passed) and ``loss_mask``
    against ``batch``; one ``ValueError`` naming the field and the rule, before any rank is asked."""
    ids = batch.input_ids
    missing = [name for name in policy.required_fields() if given.get(name) is None]
    if missing:
        need = " and ".join(f"{name} [B, S]" for name in missing)
        raise ValueError(f"train_step: loss={_kind(policy)!r} needs {need} (kl_coef > 0 needs ref_logprobs)")
    predicted = predicted_positions(ids, batch.token_mask.long(), batch.document_ids)
    predicted &= batch.labels != IGNORE_INDEX
    mask = predicted
    if loss_mask is not None:
        marked = _per_token(loss_mask, ids, "loss_mask") != 0
        stray = marked & ~predicted
        if bool(stray.any()):
            row, col = (int(i) for i in stray.nonzero()[0])
            raise ValueError(
                f"train_step: loss_mask marks token [{row}, {col}], which has no log-prob (the first token of a row "
                "or document, padding, or a label of -100); mark only tokens a distribution predicted"
            )
        mask = marked
    fields = {
        name: _finite(_per_token(value, ids, name), mask, name)
        for name in TOKEN_FIELDS
        if (value := given.get(name)) is not None
    }
    tokens = int(mask.sum())
    if tokens == 0:
        raise ValueError("train_step: the batch has no loss tokens (loss_mask, labels and padding leave none)")
    weights, normalizer = _aggregate(mask, policy)
    fields["weights"] = weights
    return PolicyStep(policy, fields, normalizer, tokens)


def policy_metrics(step: PolicyStep, firsts: list[StepResult]) -> dict[str, Any]:
    """A policy step's loss and statistics from each batch's answer (:mod:`raymoe.rank.objective`)."""
    loss_sum = sum(r.loss_sum for r in firsts)
    sums = [sum(values) for values in zip(*(r.policy_stats or () for r in firsts), strict=True)]
    tokens = step.num_loss_tokens
    if step.policy.is_callable:
        normalizer = sums[0]
        return {"loss": loss_sum / normalizer, "normalizer": normalizer, "num_tokens": tokens}
    pg, kl, clipped, approx = sums
    n = step.normalizer
    return {
        "loss": loss_sum / n,
        "policy_loss": pg / n,
        "kl": kl / n,
        "clip_fraction": clipped / tokens,
        "approx_kl": approx / tokens,
        "num_tokens": tokens,
    }


def _aggregate(mask: Tensor, policy: PolicyLoss) -> tuple[Tensor, float]:
    weights = mask.float()
    if policy.is_callable:
        return weights, 1.0
    if policy.loss_aggregation == "sequence-mean":
        per_row = mask.sum(dim=1, keepdim=True)
        return weights / per_row.clamp_min(1), float((per_row > 0).sum())
    if policy.loss_aggregation == "token-sum-norm":
        assert policy.max_new_tokens is not None  # checked with the loss
        return weights, float(mask.shape[0] * policy.max_new_tokens)
    return weights, float(mask.sum())


def _per_token(value: object, ids: Tensor, name: str) -> Tensor:
    """``value`` as a float32 CPU tensor shaped like ``ids``, or a ``ValueError`` naming it."""
    if not isinstance(value, Tensor) or tuple(value.shape) != tuple(ids.shape):
        shape = list(value.shape) if isinstance(value, Tensor) else type(value).__name__
        raise ValueError(
            f"train_step: {name} must be a tensor [B, S] shaped like input_ids {list(ids.shape)}, got {shape}"
        )
    if value.is_complex():
        raise ValueError(f"train_step: {name} must be real numbers, got dtype {value.dtype}")
    return value.detach().to("cpu", torch.float32)


def _finite(value: Tensor, mask: Tensor, name: str) -> Tensor:
    """``value`` with NaN or infinity refused where a token takes loss (elsewhere it is replaced by 0)."""
    bad = ~torch.isfinite(value) & mask
    if bool(bad.any()):
        row, col = (int(i) for i in bad.nonzero()[0])
        raise ValueError(f"train_step: {name}[{row}, {col}] = {float(value[row, col])} is not finite")
    return torch.where(mask, value, torch.zeros(()))


def _kind(policy: PolicyLoss) -> str:
    return "callable" if policy.is_callable else policy.kind
