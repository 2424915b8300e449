"""The handle's reinforcement-learning methods (``DistributedModel`` inherits them): per-token log-probabilities,
and the weights streamed to a rollout engine. Policy losses and router replay are options of ``train_step``
and ``generate``.

    logprobs(ids, ...)            -> [B, S] (or TokenLogprobs with entropy / routes)   raymoe.driver.logprobs
    iter_hub_weights(bucket)      -> buckets of (hub name, full tensor)                 raymoe.driver.weight_stream
    push_weights(receivers, ...)  the same buckets, sent from the ranks to Ray actors   raymoe.driver.weight_stream
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from raymoe.driver import weight_stream
from raymoe.driver.fanout import FanOut
from raymoe.driver.logprobs import Logprobs, TokenLogprobs


class ReinforcementMethods:
    """Mixed into :class:`~raymoe.driver.handle.DistributedModel`, whose rooms it uses."""

    _logprobs: Logprobs
    _fanout: FanOut

    def logprobs(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        *,
        temperature: float = 1.0,
        document_ids: Tensor | None = None,
        return_entropy: bool = False,
        return_routed_experts: bool = False,
        routed_experts: Tensor | None = None,
    ) -> Tensor | TokenLogprobs:
        """``[B, S]`` float32: entry ``t`` is ``log p(input_ids[t] | input_ids[:t])`` at ``temperature``
        (``log_softmax(logits / temperature)`` at the next token), computed on the ranks (vocabulary-parallel
        under TP: the ``[B, S, V]`` logits never reach the driver). Entry 0, padding, a left-padded row's first
        real token and each packed document's first token are 0. Any ``B`` on any layout.

        ``return_entropy`` / ``return_routed_experts``: a :class:`~raymoe.driver.logprobs.TokenLogprobs` with
        ``entropy [B, S]`` and ``routed_experts [B, S, L_moe, K]`` int16 (the experts each token's forward chose,
        global ids, slot ``j`` the ``j``-th sparse layer). ``routed_experts=R``: every router uses ``R`` instead of
        its top-k choice (the gate weights still come from its scores at those ids; no capacity drop).
        """
        result = self._logprobs.compute(
            input_ids, attention_mask, temperature, document_ids, return_entropy, return_routed_experts, routed_experts
        )
        return result if return_entropy or return_routed_experts else result.logprobs

    def iter_hub_weights(
        self, bucket_bytes: int = weight_stream.DEFAULT_BUCKET_BYTES, dtype: torch.dtype | None = None
    ) -> Iterator[list[tuple[str, Tensor]]]:
        """Buckets of ``(hub_name, tensor)``: full CPU tensors in the hub layout, the names and values
        :meth:`save_pretrained` writes (LoRA merged, packed experts dequantized; ``dtype`` None: the checkpoint's),
        gathered on the ranks one bucket of about ``bucket_bytes`` at a time. Closing the iterator early frees
        the ranks' stream."""
        return weight_stream.iter_hub_weights(self._fanout, bucket_bytes, dtype)

    def push_weights(
        self,
        receivers: Sequence[Any],
        method: str = "load_weights",
        bucket_bytes: int = weight_stream.DEFAULT_BUCKET_BYTES,
        dtype: torch.dtype | None = None,
    ) -> dict[str, Any]:
        """Send :meth:`iter_hub_weights`'s buckets to Ray actor handles (``receiver.<method>.remote(bucket)``, e.g. a
        wrapper around a vLLM or SGLang worker's ``load_weights``) from the ranks, through Ray's object store and
        never through the driver; returns once every receiver has applied the last bucket (buckets, bytes,
        seconds)."""
        return weight_stream.push_weights(self._fanout, receivers, method, bucket_bytes, dtype)
