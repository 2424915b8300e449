"""Top-k softmax router, with an optional per-expert selection bias and an optional capacity limit.

Shape legend: ``T`` tokens, ``H`` hidden size, ``E`` experts, ``K`` experts per token, ``S`` tokens per
sequence (the capacity unit).

    logits [T, E] = hidden @ weight.T (+ bias)   probs = softmax(logits) in float32
    choice:  top-K of probs (+ selection_bias, if the family has one: DeepSeek-V3's
             e_score_correction_bias; it moves the choice, never the weights)
    weights: probs of the chosen experts (renormalised to sum to one with norm_topk_prob)
    capacity (training only, optional): an expert takes at most C = ceil(cf * S * K / E) pairs of
             each sequence; the lowest-probability pairs beyond that are dropped (id - E < 0)

While ``record`` is on, the last training-mode forward's :class:`RoutingRecord` is kept for load
statistics, the auxiliary loss and bias balancing (:mod:`raymoe.models.moe.balance`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from raymoe.models.moe.balance import over_capacity
from raymoe.models.moe.experts import tokens_per_expert


@dataclass
class RoutingRecord:
    """One router forward, as training needs it.

    ``probs_TE`` (float32, with its gradient) feeds the auxiliary loss; ``chosen_TK`` are the global
    ids the router chose, before any capacity drop; ``dropped_TK`` marks the pairs the capacity
    limit dropped (None without a limit).
    """

    probs_TE: Tensor
    chosen_TK: Tensor
    dropped_TK: Tensor | None = None

    @property
    def num_dropped(self) -> Tensor:
        """Dropped (token, expert) pairs, a 0-d int64 tensor (no host sync)."""
        if self.dropped_TK is None:
            return torch.zeros((), dtype=torch.int64, device=self.chosen_TK.device)
        return self.dropped_TK.sum()


class TopKRouter(nn.Module):
    """Scores every expert for each token and keeps the ``top_k`` best.

    ``weight [E, H]`` is the hub's ``mlp.gate.weight``; ``bias [E]`` (gpt-oss's ``mlp.router.bias``)
    adds to the logits; ``selection_bias [E]`` (hub name ``mlp.gate.e_score_correction_bias``) exists
    only when the family has one. The softmax runs in float32 over all experts; with ``norm_topk_prob``
    the kept probabilities are renormalised, which equals a softmax over the top-k logits (gpt-oss).
    """

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        norm_topk_prob: bool,
        *,
        bias: bool = False,
        selection_bias: bool = False,
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.bias = nn.Parameter(torch.empty(num_experts)) if bias else None
        # Not trained by the optimizer: bias balancing moves it after each step (SPEC LB-2).
        self.e_score_correction_bias = (
            nn.Parameter(torch.zeros(num_experts), requires_grad=False) if selection_bias else None
        )
        # Training settings: keep a RoutingRecord of each forward; drop pairs beyond this capacity factor.
        self.record = False
        self.capacity_factor: float | None = None
        self.last_routing: RoutingRecord | None = None

    @property
    def has_selection_bias(self) -> bool:
        return self.e_score_correction_bias is not None

    def forward(self, hidden_TH: Tensor, sequence_length: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """``hidden: [T, H]`` -> ``(topk_ids [T, K] int64, topk_weights [T, K] in hidden's dtype, logits [T, E])``.

        ``sequence_length`` (``S``, with ``T = B * S``) is the capacity unit; without it a capacity
        factor cannot apply and the whole of ``T`` counts as one sequence.
        """
        logits_TE = F.linear(hidden_TH, self.weight, self.bias)
        probs_TE = torch.softmax(logits_TE, dim=-1, dtype=torch.float32)
        if self.e_score_correction_bias is None:
            topk_weights_TK, topk_ids_TK = torch.topk(probs_TE, self.top_k, dim=-1)
        else:
            _, topk_ids_TK = torch.topk(probs_TE + self.e_score_correction_bias.float(), self.top_k, dim=-1)
            topk_weights_TK = probs_TE.gather(-1, topk_ids_TK)
        chosen_TK = topk_ids_TK
        dropped_TK = None
        if self.training and self.capacity_factor is not None:
            length = sequence_length or hidden_TH.shape[0]
            dropped_TK = over_capacity(chosen_TK, topk_weights_TK, length, self.num_experts, self.capacity_factor)
            topk_ids_TK = torch.where(dropped_TK, chosen_TK - self.num_experts, chosen_TK)  # < 0: skip the expert
        if self.norm_topk_prob:
            topk_weights_TK = topk_weights_TK / topk_weights_TK.sum(dim=-1, keepdim=True)
        if self.record and self.training:
            self.last_routing = RoutingRecord(probs_TE, chosen_TK.detach(), dropped_TK)
        return topk_ids_TK, topk_weights_TK.to(logits_TE.dtype), logits_TE

    @property
    def last_load(self) -> Tensor | None:
        """``[E]`` int64 pairs per expert the last recorded forward chose (before capacity drops)."""
        if self.last_routing is None:
            return None
        return tokens_per_expert(self.last_routing.chosen_TK, self.num_experts)

    def extra_repr(self) -> str:
        bias = ", bias" if self.bias is not None else ""
        bias += ", selection_bias" if self.has_selection_bias else ""
        return f"experts={self.num_experts}, top_k={self.top_k}, norm_topk_prob={self.norm_topk_prob}{bias}"
