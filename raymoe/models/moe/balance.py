"""Load-balancing math of a mixture-of-experts layer (SPEC LB-2), on plain tensors: no process groups here.

Shape legend: ``T`` tokens, ``K`` experts per token, ``E`` experts, ``S`` tokens per sequence,
``L`` MoE layers.

Auxiliary loss (Switch Transformer), in two scopes::

    pooled (transformers' load_balancing_loss_func; the checkpoint convention)
        f_e = C_e / N      C_e: (token, expert) pairs that chose e, summed over layers;  N: tokens x layers
        P_e = S_e / N      S_e: router probability of e, summed over tokens and layers
        aux = E * sum_e f_e * P_e
    per layer (Megatron, GShard): the same within each layer, then the mean over layers
        aux = 1/L * sum_l E * sum_e (C_le / T) * (S_le / T)      T: tokens

Pooling sums expert e of every layer together, so it cannot see a layer overloading an expert that
another layer under-uses (measured on the demo model: pooled aux at its minimum, 2.0, while single
layers stay at max/mean 2); the per-layer scope can. Both equal ``top_k`` when perfectly balanced.
``C`` and ``T`` carry no gradient; ``S`` does. The sum over data-parallel ranks of
:func:`aux_loss_share` with the *global* ``C`` and ``T`` is the aux loss of the global batch, so each
rank back-propagates only its own share (``raymoe.rank.balance`` reduces ``C`` and ``T``).

Bias balancing (DeepSeek-V3, auxiliary-loss-free): after each step every expert's selection bias
moves by ``rate`` towards balance, ``bias += rate * sign(mean_load - load)`` (:func:`bias_step`).

Capacity: an expert takes at most ``ceil(cf * S * K / E)`` pairs of each sequence; the
lowest-probability pairs beyond that are dropped (:func:`over_capacity`). The unit is the
sequence, so the same pairs drop under every layout.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def aux_loss_share(
    prob_sum_LE: Tensor, global_counts_LE: Tensor, global_tokens: Tensor, *, per_layer: bool = False
) -> Tensor:
    """This rank's part of the aux loss, with its own probability sums ``S`` and the global ``C`` and ``T``.

    ``prob_sum_LE`` (float32, with gradient): this rank's router probabilities summed over its tokens,
    per layer; ``global_counts_LE`` / ``global_tokens``: chosen pairs per layer and the real tokens of the
    global batch. ``per_layer`` picks the scope (see the module docstring).
    """
    num_layers, num_experts = prob_sum_LE.shape
    tokens = global_tokens.clamp_min(1.0)
    if per_layer:
        return num_experts * torch.sum((global_counts_LE / tokens) * (prob_sum_LE / tokens)) / num_layers
    rows = tokens * num_layers
    return num_experts * torch.sum((global_counts_LE.sum(dim=0) / rows) * (prob_sum_LE.sum(dim=0) / rows))


def bias_step(load_LE: Tensor, rate: float) -> Tensor:
    """``[L, E]``: how much each layer's selection bias moves, ``rate * sign(mean_load - load)`` per expert."""
    mean_L1 = load_LE.float().mean(dim=-1, keepdim=True)
    return rate * torch.sign(mean_L1 - load_LE.float())


def capacity(sequence_length: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """Pairs one expert takes from one sequence: ``ceil(cf * S * K / E)``."""
    return math.ceil(capacity_factor * sequence_length * top_k / num_experts)


def over_capacity(
    ids_TK: Tensor, probs_TK: Tensor, sequence_length: int, num_experts: int, capacity_factor: float
) -> Tensor:
    """``[T, K]`` bool: the pairs beyond their expert's capacity in their sequence (``T = B * S``).

    Within each (sequence, expert) the pairs are ranked by router probability, highest first (earlier
    tokens first among equals); those ranked at or past the capacity are dropped. No host sync.
    """
    num_tokens, top_k = ids_TK.shape
    if num_tokens % sequence_length:
        raise ValueError(f"capacity: {num_tokens} tokens are not whole sequences of {sequence_length}")
    limit = capacity(sequence_length, top_k, num_experts, capacity_factor)
    sequence_T = torch.arange(num_tokens, device=ids_TK.device) // sequence_length
    group_P = (sequence_T[:, None] * num_experts + ids_TK).reshape(-1)  # one group per (sequence, expert)
    by_prob_P = torch.argsort(-probs_TK.detach().reshape(-1), stable=True)
    order_P = by_prob_P[torch.argsort(group_P[by_prob_P], stable=True)]  # by group, then probability
    num_groups = (num_tokens // sequence_length) * num_experts
    counts_G = torch.zeros(num_groups, dtype=torch.int64, device=ids_TK.device)
    counts_G.scatter_add_(0, group_P, torch.ones_like(group_P))
    starts_G = torch.cumsum(counts_G, dim=0) - counts_G
    rank_sorted_P = torch.arange(group_P.numel(), device=ids_TK.device) - starts_G[group_P[order_P]]
    rank_P = torch.empty_like(rank_sorted_P).scatter_(0, order_P, rank_sorted_P)
    return (rank_P >= limit).view(num_tokens, top_k)
