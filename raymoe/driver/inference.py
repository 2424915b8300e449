"""The handle's forward passes: logits of a global batch, and generation, whole or one step at a time (SPEC INF-1).

Everything is checked here, on the driver, before any rank is asked; the rows then go out by data-parallel
batch (:mod:`raymoe.driver.fanout`) to :mod:`raymoe.rank.infer`, and the answers come back as one batch.

    logits(ids [B, S], mask, last, documents)  -> [B, S, V] (or [B, V] at each row's last real token)
    generate(prompts, n, options)             -> [B, S + n] tensor, or each prompt's list + continuation
    stream(prompts, n, options)               -> per step, each row's new token (None once finished)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from raymoe.driver.batch import check_document_ids, check_input_ids, check_right_padded, check_sequence_length
from raymoe.driver.fanout import FanOut, RowSplit, split_rows
from raymoe.driver.prompts import (
    PromptBatch,
    as_output,
    check_attention_mask,
    check_stop_sequences,
    check_token_ids,
    prompt_batch,
    routes_as_output,
)
from raymoe.driver.routes import route_shape
from raymoe.models.common.config import ModelConfig
from raymoe.models.common.generation import SamplingConfig, stop_rules, trim_finished
from raymoe.rank.contract import DecodeRequest
from raymoe.rank.infer import end_stream, forward_logits, generate_tokens, start_stream, stream_step


@dataclass(frozen=True)
class GenerationOptions:
    """How ``generate`` and ``generate_stream`` continue prompts (their keyword options, checked on the driver).

    Greedy by default. ``do_sample`` applies ``temperature``, then ``top_k``, then ``top_p``, drawing from
    ``(seed, the row's index, the step)``: the same seed gives the same tokens under every layout. A row finishes
    at an ``eos_token_ids`` token (default: the config's) or at the end of a ``stop_sequences`` entry (both kept);
    a tensor's finished rows are padded with ``pad_token_id`` (default: the config's, else the first eos id).
    ``return_routed_experts``: ``generate`` answers ``(tokens, routes)`` (router replay, MoE models).
    """

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0
    seed: int = 0
    eos_token_ids: Sequence[int] | None = None
    stop_sequences: Sequence[Sequence[int]] = ()
    pad_token_id: int | None = None
    return_routed_experts: bool = False  # router replay: also every token's experts (generate only)

    @classmethod
    def of(cls, method: str, options: dict[str, Any]) -> GenerationOptions:
        """The options given to ``method`` as keywords; a ``ValueError`` naming any unknown one."""
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise ValueError(f"{method}: unknown option(s) {', '.join(unknown)}; the options are {', '.join(known)}")
        return cls(**options)


@dataclass(frozen=True)
class Decoding:
    """A checked generation: the left-padded prompts, their split over the batches and the ranks' request."""

    batch: PromptBatch
    split: RowSplit
    request: DecodeRequest

    def args_of_batch(self) -> list[tuple[Any, ...]]:
        ids = self.split.take(self.batch.input_ids)
        masks = self.split.take(self.batch.attention_mask)
        return [(i, m, rows, self.request) for i, m, rows in zip(ids, masks, self.split.rows, strict=True)]


def check_forward_batch(
    config: ModelConfig, input_ids: object, attention_mask: object | None, document_ids: object | None
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """A forward pass's ``(ids [B, S], mask or None, documents or None)`` checked on the driver: padding on either
    side (only trailing with packed rows, which read no padding mask), within the model's positions."""
    ids = check_input_ids(input_ids, config.vocab_size)
    mask = check_attention_mask(attention_mask, ids) if attention_mask is not None else None
    documents = check_document_ids(document_ids, ids) if document_ids is not None else None
    if documents is not None and mask is not None:
        check_right_padded(mask)
    check_sequence_length(ids.shape[1], config.max_position_embeddings)
    return ids, mask, documents


class Inference:
    """Forward passes of one loaded model: ``config`` checks the inputs, ``fanout`` reaches the ranks."""

    def __init__(self, config: ModelConfig, fanout: FanOut, alive: Callable[[], bool]) -> None:
        self.config, self.fanout, self._alive = config, fanout, alive

    def logits(
        self, input_ids: Tensor, attention_mask: Tensor | None, return_logits: str, document_ids: Tensor | None
    ) -> Tensor:
        if return_logits not in ("all", "last"):
            raise ValueError(f"return_logits={return_logits!r}: choose 'all' or 'last'")
        ids, mask, documents = check_forward_batch(self.config, input_ids, attention_mask, document_ids)
        split = split_rows(ids.shape[0], self.fanout.topology.config.dp_size)
        parts = (split.take(part) for part in (ids, mask, documents))
        args = [(i, m, return_logits == "last", d) for i, m, d in zip(*parts, strict=True)]
        return split.gather(self.fanout.per_batch(forward_logits, args))

    def generate(self, prompts: object, max_new_tokens: object, attention_mask: object | None,
                 options: GenerationOptions) -> Any:  # fmt: skip
        """The tokens (see ``DistributedModel.generate``); with ``return_routed_experts`` also their routes,
        ``[B, S + n, L_moe, K]`` for a tensor (padding and finished rows' pad steps included) or each list's own."""
        decoding = self.decoding(prompts, max_new_tokens, attention_mask, options)
        answers = self.fanout.per_batch(generate_tokens, decoding.args_of_batch())
        width = max(answer[0].shape[1] for answer in answers)
        pad = decoding.request.stop.pad_id
        split = decoding.split
        tokens = split.gather([F.pad(answer[0], (0, width - answer[0].shape[1]), value=pad) for answer in answers])
        lengths = split.gather([answer[1] for answer in answers])
        prompt_width = decoding.batch.input_ids.shape[1]
        kept = trim_finished(tokens, prompt_width, lengths)
        output = as_output(kept, decoding.batch, lengths)
        if not options.return_routed_experts:
            return output
        routes = split.gather([F.pad(a[2], (0, 0, 0, 0, 0, width - a[2].shape[1])) for a in answers])
        return output, routes_as_output(routes[:, : kept.shape[1]], decoding.batch, lengths)

    def stream(self, prompts: object, max_new_tokens: object, attention_mask: object | None,
               options: GenerationOptions) -> Iterator[list[int | None]]:  # fmt: skip
        """Checked now (before the first step); the steps run as the caller iterates."""
        if options.return_routed_experts:
            raise ValueError("generate_stream: return_routed_experts is an option of generate (the whole rows)")
        return self._steps(self.decoding(prompts, max_new_tokens, attention_mask, options))

    def _steps(self, decoding: Decoding) -> Iterator[list[int | None]]:
        self.fanout.to_batches(start_stream, decoding.args_of_batch())
        split, request = decoding.split, decoding.request
        finished = torch.zeros(decoding.batch.num_rows, dtype=torch.bool)
        try:
            for _ in range(request.max_new_tokens):
                answers = self.fanout.per_batch(stream_step, [()] * len(split.rows))
                tokens = split.gather([t for t, _ in answers])
                yield [None if done else int(t) for t, done in zip(tokens, finished.tolist(), strict=True)]
                finished = split.gather([f for _, f in answers])
                if request.stop.can_stop and bool(finished.all()):
                    break
        finally:
            if self._alive():
                self.fanout.every_rank(end_stream)

    def decoding(
        self, prompts: object, max_new_tokens: object, attention_mask: object | None, options: GenerationOptions
    ) -> Decoding:
        """Every argument of a generation checked on the driver, before any rank is asked."""
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
        config = self.config
        sampling = SamplingConfig(options.do_sample, options.temperature, options.top_k, options.top_p, options.seed)
        stop = stop_rules(
            config,
            check_token_ids(options.eos_token_ids, config.vocab_size, "eos_token_ids"),
            check_stop_sequences(options.stop_sequences, config.vocab_size),
            options.pad_token_id,
        )
        batch = prompt_batch(prompts, attention_mask, config.vocab_size, stop.pad_id)
        check_sequence_length(batch.input_ids.shape[1] + max_new_tokens, config.max_position_embeddings)
        if options.return_routed_experts:
            route_shape(config, batch.num_rows, batch.input_ids.shape[1])  # a dense model has none: refused
        split = split_rows(batch.num_rows, self.fanout.topology.config.dp_size)
        request = DecodeRequest(max_new_tokens, sampling, stop, keep_routes=bool(options.return_routed_experts))
        return Decoding(batch, split, request)
