"""Top-k router (softmax or sigmoid scores), with an optional per-expert selection bias, group-limited
choice and an optional capacity limit.

Shape legend: ``T`` tokens, ``H`` hidden size, ``E`` experts, ``K`` experts per token, ``S`` tokens per
sequence (the capacity unit), ``G`` expert groups.

    logits [T, E] = hidden @ weight.T (+ bias)
    probs = softmax(logits) in float32, or sigmoid(logits) per expert (``scoring="sigmoid"``: DeepSeek-V3,
            GLM-4.5; logits computed in float32 there)
    choice:  top-K of probs (+ selection_bias, if the family has one: DeepSeek-V3's
             e_score_correction_bias; it moves the choice, never the weights); with ``n_group > 1`` only
             among the experts of the ``topk_group`` best of ``G`` equal groups, a group scoring the sum
             of its two best (biased) probs
    weights: probs of the chosen experts (renormalised to sum to one with norm_topk_prob; sigmoid adds
             1e-20 to the sum), times ``scaling`` (``routed_scaling_factor``)
    capacity (training only, optional): an expert takes at most C = ceil(cf * S * K / E) pairs of
             each sequence; the lowest-probability pairs beyond that are dropped (id - E < 0)

While ``record`` is on, the last training-mode forward's :class:`RoutingRecord` is kept for load
statistics, the auxiliary loss and bias balancing (:mod:`raymoe.models.moe.balance`).

Router replay (RL: :mod:`raymoe.models.moe.replay`): ``forced_TK`` given to the forward replaces the top-K
choice by those global ids; the weights are still the current probs at them, normalised and scaled as above
(so the router keeps learning), and no capacity limit drops a replayed pair. While ``keep_routes`` is on,
every forward (training or not) leaves the ids it used in ``kept_routes_TK``.
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
        scoring: str = "softmax",
        n_group: int = 1,
        topk_group: int = 1,
        scaling: float = 1.0,
    ) -> None:
        super().__init__()
        if scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"router scoring must be 'softmax' or 'sigmoid', got {scoring!r}")
        if num_experts % n_group or not 1 <= topk_group <= n_group:
            raise ValueError(
                f"router groups: {num_experts} experts in n_group={n_group} groups, topk_group={topk_group}: "
                "n_group must divide the experts and topk_group lie in [1, n_group]"
            )
        if n_group > 1 and num_experts // n_group < 2:
            raise ValueError(
                f"router groups: each of n_group={n_group} groups needs at least 2 of {num_experts} experts"
            )
        if n_group > 1 and top_k > topk_group * (num_experts // n_group):
            raise ValueError(
                f"router: num_experts_per_tok={top_k} exceeds the {topk_group} x {num_experts // n_group} experts "
                f"of the topk_group={topk_group} groups it may choose from"
            )
        self.num_experts = num_experts
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.scoring = scoring
        self.n_group = n_group
        self.topk_group = topk_group
        self.scaling = scaling
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.bias = nn.Parameter(torch.empty(num_experts)) if bias else None
        # Not trained by the optimizer: bias balancing moves it after each step (SPEC LB-2).
        self.e_score_correction_bias = (
            nn.Parameter(torch.zeros(num_experts), requires_grad=False) if selection_bias else None
        )
        # Held in float32 whatever the model's dtype: its bias-balancing steps (~1e-3) vanish in bf16.
        self.float32_parameters = ("e_score_correction_bias",) if selection_bias else ()
        # Training settings: keep a RoutingRecord of each forward; drop pairs beyond this capacity factor.
        self.record = False
        self.capacity_factor: float | None = None
        self.last_routing: RoutingRecord | None = None
        # Router replay: keep the ids of each forward (any mode) for the caller to take.
        self.keep_routes = False
        self.kept_routes_TK: Tensor | None = None

    @property
    def has_selection_bias(self) -> bool:
        return self.e_score_correction_bias is not None

    def forward(
        self, hidden_TH: Tensor, sequence_length: int | None = None, forced_TK: Tensor | None = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """``hidden: [T, H]`` -> ``(topk_ids [T, K] int64, topk_weights [T, K] in hidden's dtype, logits [T, E])``.

        ``sequence_length`` (``S``, with ``T = B * S``) is the capacity unit; without it a capacity
        factor cannot apply and the whole of ``T`` counts as one sequence. ``forced_TK`` (global ids,
        any integer dtype): replayed routes, used instead of the top-K choice.
        """
        if self.scoring == "sigmoid":
            bias = self.bias.float() if self.bias is not None else None
            logits_TE = F.linear(hidden_TH.float(), self.weight.float(), bias)
            probs_TE = torch.sigmoid(logits_TE)
        else:
            logits_TE = F.linear(hidden_TH, self.weight, self.bias)
            probs_TE = torch.softmax(logits_TE, dim=-1, dtype=torch.float32)
        if forced_TK is not None:
            topk_ids_TK = forced_TK.to(torch.int64)
            topk_weights_TK = probs_TE.gather(-1, topk_ids_TK)
        elif self.e_score_correction_bias is None and self.n_group == 1:
            topk_weights_TK, topk_ids_TK = torch.topk(probs_TE, self.top_k, dim=-1)
        else:
            _, topk_ids_TK = torch.topk(self._choice_scores(probs_TE), self.top_k, dim=-1)
            topk_weights_TK = probs_TE.gather(-1, topk_ids_TK)
        chosen_TK = topk_ids_TK
        dropped_TK = None
        if self.keep_routes:
            self.kept_routes_TK = chosen_TK.detach()
        if self.training and self.capacity_factor is not None and forced_TK is None:
            length = sequence_length or hidden_TH.shape[0]
            dropped_TK = over_capacity(chosen_TK, topk_weights_TK, length, self.num_experts, self.capacity_factor)
            topk_ids_TK = torch.where(dropped_TK, chosen_TK - self.num_experts, chosen_TK)  # < 0: skip the expert
        if self.norm_topk_prob:
            tiny = 1e-20 if self.scoring == "sigmoid" else 0.0
            topk_weights_TK = topk_weights_TK / (topk_weights_TK.sum(dim=-1, keepdim=True) + tiny)
        if self.scaling != 1.0:
            topk_weights_TK = topk_weights_TK * self.scaling
        if self.record and self.training:
            self.last_routing = RoutingRecord(probs_TE, chosen_TK.detach(), dropped_TK)
        return topk_ids_TK, topk_weights_TK.to(logits_TE.dtype), logits_TE

    def _choice_scores(self, probs_TE: Tensor) -> Tensor:
        """``[T, E]`` what the choice ranks: probs plus the selection bias, -inf outside the kept groups."""
        scores_TE = probs_TE
        if self.e_score_correction_bias is not None:
            scores_TE = probs_TE + self.e_score_correction_bias.float()
        if self.n_group == 1:
            return scores_TE
        tokens = scores_TE.shape[0]
        grouped_TGX = scores_TE.view(tokens, self.n_group, -1)
        group_scores_TG = grouped_TGX.topk(2, dim=-1).values.sum(dim=-1)
        kept_TG = torch.zeros_like(group_scores_TG, dtype=torch.bool)
        kept_TG.scatter_(1, torch.topk(group_scores_TG, self.topk_group, dim=-1).indices, True)
        return grouped_TGX.masked_fill(~kept_TG[:, :, None], float("-inf")).view(tokens, -1)

    @property
    def last_load(self) -> Tensor | None:
        """``[E]`` int64 pairs per expert the last recorded forward chose (before capacity drops)."""
        if self.last_routing is None:
            return None
        return tokens_per_expert(self.last_routing.chosen_TK, self.num_experts)

    def extra_repr(self) -> str:
        bias = ", bias" if self.bias is not None else ""
        bias += ", selection_bias" if self.has_selection_bias else ""
        groups = f", groups={self.topk_group}/{self.n_group}" if self.n_group > 1 else ""
        scaling = f", scaling={self.scaling}" if self.scaling != 1.0 else ""
        return (
            f"experts={self.num_experts}, top_k={self.top_k}, scoring={self.scoring}, "
            f"norm_topk_prob={self.norm_topk_prob}{bias}{groups}{scaling}"
        )
