"""The handle's per-token log-probabilities (RL): checked here, computed on the ranks, zeroed where undefined.

    logprobs(ids [B, S], mask, T, docs, routes)  -> [B, S] float32 (+ entropy [B, S], + routes [B, S, L_moe, K])

Entry ``t`` is ``log p(ids[t] | ids[:t])`` at temperature ``T``. It is 0 where no distribution predicted the
token: entry 0, padding, the first real token of a left-padded row, and (packed rows) each document's first
token. The ranks compute it where the logits are (:mod:`raymoe.rank.logprobs`); only ``[B, S]`` values travel.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from raymoe.driver.batch import (
    document_starts,
)
from raymoe.driver.fanout import FanOut, split_rows
from raymoe.driver.inference import check_forward_batch
from raymoe.driver.routes import check_routes
from raymoe.models.common.config import ModelConfig
from raymoe.rank.contract import LogprobRequest
from raymoe.rank.logprobs import token_logprobs


@dataclass(frozen=True)
class TokenLogprobs:
    """What ``logprobs`` answers: ``logprobs [B, S]``, and on request ``entropy [B, S]`` and ``routed_experts
    [B, S, L_moe, K]`` (int16, the experts each token's forward used); None where not asked for."""

    logprobs: Tensor
    entropy: Tensor | None = None
    routed_experts: Tensor | None = None


def predicted_positions(ids: Tensor, mask: Tensor | None, documents: Tensor | None) -> Tensor:
    """``[B, S]`` bool: the tokens a distribution predicted (the token and the one before it real, same document)."""
    valid = torch.ones_like(ids, dtype=torch.bool)
    valid[:, 0] = False
    if mask is not None:
        real = mask != 0
        valid[:, 1:] &= real[:, 1:] & real[:, :-1]
    if documents is not None:
        valid &= ~document_starts(documents)
    return valid


def check_temperature(temperature: object, method: str) -> float:
    ok = isinstance(temperature, int | float) and not isinstance(temperature, bool)
    if not ok or not math.isfinite(float(temperature)) or float(temperature) <= 0:  # type: ignore[arg-type]
        raise ValueError(f"{method}: temperature={temperature!r} must be a finite number > 0")
    return float(temperature)  # type: ignore[arg-type]


class Logprobs:
    """Per-token log-probabilities of one loaded model: ``config`` checks the inputs, ``fanout`` reaches the ranks."""

    def __init__(self, config: ModelConfig, fanout: FanOut) -> None:
        self.config, self.fanout = config, fanout

    def compute(
        self,
        input_ids: object,
        attention_mask: object | None,
        temperature: object,
        document_ids: object | None,
        return_entropy: bool,
        return_routes: bool,
        routes: object | None,
    ) -> TokenLogprobs:
        ids, mask, documents = check_forward_batch(self.config, input_ids, attention_mask, document_ids)
        replay = check_routes(routes, self.config, ids, "logprobs") if routes is not None else None
        if return_routes and self.config.moe is None:
            raise ValueError(f"logprobs: return_routed_experts=True: {self.config.model_type} is a dense model")
        request = LogprobRequest(
            check_temperature(temperature, "logprobs"),
            bool(return_entropy),
            bool(return_routes),
            len(self.config.sparse_slots()),
        )
        split = split_rows(ids.shape[0], self.fanout.topology.config.dp_size)
        parts = (split.take(part) for part in (ids, mask, documents, replay))
        args = [(i, m, d, r, request) for i, m, d, r in zip(*parts, strict=True)]
        answers = self.fanout.per_batch(token_logprobs, args)
        valid = predicted_positions(ids, mask, documents)
        logprobs = split.gather([a[0] for a in answers]).masked_fill(~valid, 0.0)
        entropy = split.gather([a[1] for a in answers]).masked_fill(~valid, 0.0) if return_entropy else None
        routes_out = split.gather([a[2] for a in answers]) if return_routes else None
        return TokenLogprobs(logprobs, entropy, routes_out)
