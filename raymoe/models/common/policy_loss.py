"""Per-token policy-gradient losses (RL): importance sampling, PPO's clipped surrogate, the k3 KL estimate.

Every input is ``[B, S]`` aligned with the tokens (:mod:`raymoe.models.common.logprobs`): ``logprobs`` (with
its graph) under the policy being trained, ``old`` under the policy that sampled the tokens, ``ref`` under a
reference policy, ``advantages`` per token. With ``ratio = exp(logprobs - old)``::

    importance_sampling   pg = -ratio * A
    ppo                   pg = max(-ratio * A, -clip(ratio, 1 - clip_low, 1 + clip_high) * A)
                          DAPO's asymmetric clip: clip_high != clip_low; dual clip (clip_c > 1):
                          where A < 0, pg = min(pg, -clip_c * A)
    kl (k3)               exp(ref - logprobs) - (ref - logprobs) - 1   >= 0, unbiased for KL(policy || ref)

How the per-token values are summed into one loss (token-mean, sequence-mean, a constant) is the caller's:
it gives each token a weight and divides by a normalizer over the whole global batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class TokenTerms:
    """``[B, S]`` per-token values: ``pg`` the policy-gradient loss (with graph), ``kl`` the k3 estimate to the
    reference (with graph; zeros without one), ``clipped`` (float 0/1) where PPO's clip is the active term,
    ``approx_kl`` the k3 estimate between the sampling and the current policy (no graph)."""

    pg: Tensor
    kl: Tensor
    clipped: Tensor
    approx_kl: Tensor


def k3(logprobs_BS: Tensor, other_BS: Tensor) -> Tensor:
    """``exp(other - logprobs) - (other - logprobs) - 1``: the k3 estimate of KL(policy || other) per token."""
    delta_BS = other_BS - logprobs_BS
    return torch.exp(delta_BS) - delta_BS - 1


def policy_terms(
    logprobs_BS: Tensor,
    old_BS: Tensor,
    advantages_BS: Tensor,
    ref_BS: Tensor | None,
    *,
    clipped: bool,
    clip_low: float,
    clip_high: float,
    clip_c: float | None,
) -> TokenTerms:
    """The per-token terms of an importance-sampling (``clipped=False``) or PPO (``clipped=True``) loss."""
    ratio_BS = torch.exp(logprobs_BS - old_BS)
    unclipped_BS = -advantages_BS * ratio_BS
    if clipped:
        bounded_BS = -advantages_BS * ratio_BS.clamp(1.0 - clip_low, 1.0 + clip_high)
        pg_BS = torch.maximum(unclipped_BS, bounded_BS)
        was_clipped_BS = (bounded_BS > unclipped_BS).float()
        if clip_c is not None:
            floor_BS = -advantages_BS * clip_c
            pg_BS = torch.where(advantages_BS < 0, torch.minimum(pg_BS, floor_BS), pg_BS)
    else:
        pg_BS, was_clipped_BS = unclipped_BS, torch.zeros_like(ratio_BS)
    kl_BS = k3(logprobs_BS, ref_BS) if ref_BS is not None else torch.zeros_like(logprobs_BS)
    return TokenTerms(pg_BS, kl_BS, was_clipped_BS.detach(), k3(logprobs_BS, old_BS).detach())
