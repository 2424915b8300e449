"""Single-process incremental decoding with a KV cache: greedy or sampled, left-padded prompts, stop rules.

The prompt is run once (prefill) to fill the cache; each further step runs only the newest
token. The head is applied to the last position only, so no ``[B, S, vocab]`` logits are built::

    prompts [B, S] (left-padded: attention_mask 0 before each row's first real token)
      | prefill: every prompt position, positions counted over real tokens only
      | step:    newest token of every row -> logits [B, V] -> next token (argmax, or sampled)
      | a row is finished after an eos id or a stop sequence: later steps write the pad id

Sampling (``do_sample``) applies ``temperature``, then ``top_k``, then ``top_p`` (the smallest set
of most likely tokens whose probability reaches ``top_p``) and draws by inverse CDF with one
uniform number per row and step. That number depends only on ``(seed, the row's index in the
global batch, the step)`` (a CPU generator seeded from the three), so the same seed gives the same
tokens however the rows are split over ranks, and a row's tokens do not depend on the other rows.
The numbers of ``UNIFORM_BLOCK`` steps are drawn at once and copied to the device together.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from raymoe.models.common.config import ModelConfig
from raymoe.models.common.decoder import CausalLM
from raymoe.models.common.transfer import to_device


@dataclass(frozen=True)
class SamplingConfig:
    """How the next token is chosen. The default is greedy; ``temperature == 0`` is greedy too."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.do_sample, bool):
            raise ValueError(f"do_sample must be true or false, got {self.do_sample!r}")
        if not _is_number(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature={self.temperature!r} must be a number >= 0 (0: greedy)")
        if self.top_k is not None and (not _is_int(self.top_k) or self.top_k < 1):
            raise ValueError(f"top_k={self.top_k!r} must be an int >= 1 or None")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p!r} must be in (0, 1]")
        if not _is_int(self.seed):
            raise ValueError(f"seed={self.seed!r} must be an int")

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.temperature == 0 or self.top_k == 1


@dataclass(frozen=True)
class StopRules:
    """When a row is finished: after an ``eos_ids`` token or a ``stop_sequences`` tail; ``pad_id`` fills it after."""

    eos_ids: tuple[int, ...] = ()
    stop_sequences: tuple[tuple[int, ...], ...] = ()
    pad_id: int = 0

    @property
    def can_stop(self) -> bool:
        return bool(self.eos_ids or self.stop_sequences)


def pick_next(logits_BV: Tensor, sampling: SamplingConfig, uniform_B: Tensor | None = None) -> Tensor:
    """``[B]`` next token ids from the last position's logits: argmax, or a draw with ``uniform_B`` in [0, 1)."""
    if sampling.greedy:
        return logits_BV.argmax(dim=-1)
    if uniform_B is None:
        raise ValueError("sampling needs one uniform number per row")
    scores_BV = logits_BV.float() / sampling.temperature
    if sampling.top_k is not None and sampling.top_k < scores_BV.shape[-1]:
        kth_B1 = torch.topk(scores_BV, sampling.top_k, dim=-1).values[:, -1:]
        scores_BV = scores_BV.masked_fill(scores_BV < kth_B1, float("-inf"))
    if sampling.top_p < 1:
        scores_BV = _nucleus(scores_BV, sampling.top_p)
    probs_BV = torch.softmax(scores_BV, dim=-1)
    cumulative_BV = probs_BV.cumsum(dim=-1)
    target_B1 = uniform_B.to(cumulative_BV)[:, None] * cumulative_BV[:, -1:]
    chosen_B = torch.searchsorted(cumulative_BV, target_B1, right=True).squeeze(-1)
    return chosen_B.clamp_max(scores_BV.shape[-1] - 1)


def _nucleus(scores_BV: Tensor, top_p: float) -> Tensor:
    """Keep the most likely tokens until their probability reaches ``top_p`` (at least one); -inf the rest."""
    sorted_BV, order_BV = torch.sort(scores_BV, dim=-1, descending=True)
    probs_BV = torch.softmax(sorted_BV, dim=-1)
    before_BV = probs_BV.cumsum(dim=-1) - probs_BV  # probability of the tokens ranked above
    drop_sorted_BV = before_BV >= top_p
    drop_BV = torch.zeros_like(drop_sorted_BV).scatter(-1, order_BV, drop_sorted_BV)
    return scores_BV.masked_fill(drop_BV, float("-inf"))


class Decoder(Protocol):
    """What a generation steps: a :class:`CausalLM`, or its stages spread over a pipeline (``raymoe.rank.pipeline``)."""

    def new_cache(self, max_length: int) -> Any: ...

    def __call__(self, input_BS: Tensor, cache: Any, mask_BS: Tensor | None, last_B: Tensor) -> Tensor: ...


class Generation:
    """One batch of prompts decoding on one model, one token per row per :meth:`step`.

    ``row_ids [B]`` are the rows' indices in the global batch (they pick the sampling numbers, see the
    module docstring); by default the batch is the global one.

    A step's work does not grow with the tokens already generated: the output ``[B, S + max_new_tokens]``
    is allocated once on the prompts' device and written one column per step; a stop sequence of ``n``
    tokens compares the buffer's last ``n`` generated columns; eos ids, stop sequences and the head's
    positions are device tensors made once. The sampling numbers are drawn on the host for
    ``UNIFORM_BLOCK`` steps at a time (the same numbers, see the module docstring) and reach the device
    in one non-blocking copy per block. Nothing in :meth:`step` waits for the device; :attr:`done` does.
    """

    def __init__(
        self,
        model: Decoder | CausalLM,
        input_ids_BS: Tensor,
        max_new_tokens: int,
        *,
        attention_mask_BS: Tensor | None = None,
        sampling: SamplingConfig | None = None,
        stop: StopRules | None = None,
        row_ids: Sequence[int] | None = None,
        spare_positions: int = 0,
    ) -> None:
        """``spare_positions``: KV-cache room for forwards after the last step (:meth:`feed_newest`)."""
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        self.model = model
        self.sampling = sampling or SamplingConfig()
        self.stop = stop or StopRules()
        self.max_new_tokens = max_new_tokens
        batch, self.prompt_length = input_ids_BS.shape
        self.cache = model.new_cache(self.prompt_length + max_new_tokens + spare_positions)
        self.device = device = input_ids_BS.device
        self.row_ids = list(row_ids) if row_ids is not None else list(range(batch))
        self.finished_B = torch.zeros(batch, dtype=torch.bool, device=device)
        # The number of tokens each row generated up to and including its stop token; -1 while running.
        self.lengths_B = torch.full((batch,), -1, dtype=torch.int64, device=device)
        # The prompts, then one column per step (pad ids until written).
        self.tokens_BL = input_ids_BS.new_full((batch, self.prompt_length + max_new_tokens), self.stop.pad_id)
        self.tokens_BL[:, : self.prompt_length] = input_ids_BS
        self.steps = 0
        self._pending: tuple[Tensor, Tensor | None] | None = (input_ids_BS, attention_mask_BS)
        self._prompt_last_B = torch.full((batch,), self.prompt_length - 1, device=device)
        self._newest_B = torch.zeros(batch, dtype=torch.int64, device=device)  # a decode step's only position
        self._eos_E = to_device(torch.tensor(self.stop.eos_ids, dtype=input_ids_BS.dtype), device)
        self._sequences = [
            to_device(torch.tensor(seq, dtype=input_ids_BS.dtype), device) for seq in self.stop.stop_sequences
        ]
        self._uniform_NB: Tensor | None = None  # [block, B]: the numbers of the current block of steps

    @property
    def done(self) -> bool:
        """Every step was taken, or every row finished (host sync)."""
        return self.steps >= self.max_new_tokens or (self.stop.can_stop and bool(self.finished_B.all()))

    def step(self) -> Tensor:
        """``[B]`` the next token of every row (``pad_id`` for a finished row)."""
        if self.steps >= self.max_new_tokens or self._pending is None:
            raise RuntimeError(f"generation already took its {self.max_new_tokens} steps")
        input_BS, mask_BS = self._pending
        last_B = self._prompt_last_B if self.steps == 0 else self._newest_B
        logits_BV = self.model(input_BS, self.cache, mask_BS, last_B)
        uniform_B = None if self.sampling.greedy else self._uniform()
        next_B = pick_next(logits_BV, self.sampling, uniform_B).masked_fill(self.finished_B, self.stop.pad_id)
        self.tokens_BL[:, self.prompt_length + self.steps] = next_B
        self.steps += 1
        stopped_B = self._stops(next_B)
        self.lengths_B.masked_fill_(stopped_B, self.steps)
        self.finished_B |= stopped_B
        self._pending = (next_B[:, None], None)
        return next_B

    def feed_newest(self) -> None:
        """Run the model once more on the tokens not yet fed (the newest ones, or the prompts before any step),
        without picking a next token: what leaves every token's routes (router replay). Needs a spare position."""
        if self._pending is None:
            raise RuntimeError("feed_newest: every token was already fed to the model")
        input_BS, mask_BS = self._pending
        last_B = self._prompt_last_B if self.steps == 0 else self._newest_B
        self.model(input_BS, self.cache, mask_BS, last_B)
        self._pending = None

    def _uniform(self) -> Tensor:
        """``[B]`` this step's number of each row on the device, from ``(seed, global row, step)`` alone."""
        offset = self.steps % UNIFORM_BLOCK
        if offset == 0 or self._uniform_NB is None:
            first = self.steps - offset
            count = min(UNIFORM_BLOCK, self.max_new_tokens - first)
            self._uniform_NB = to_device(self._numbers(first, count), self.device)
        return self._uniform_NB[offset]

    def _numbers(self, first_step: int, count: int) -> Tensor:
        """``[count, B]`` on the host: row ``b``'s number at each step from ``first_step`` (one generator each)."""
        numbers = []
        for step in range(first_step, first_step + count):
            for row in self.row_ids:
                key = (self.sampling.seed * _MIX[0] + row * _MIX[1] + step * _MIX[2]) % 2**63
                numbers.append(torch.rand(1, generator=torch.Generator().manual_seed(key)))
        return torch.cat(numbers).view(count, len(self.row_ids))

    def _stops(self, next_B: Tensor) -> Tensor:
        """Rows whose newest token is an eos id or ends a stop sequence (one that fits in the generated tokens)."""
        stops_B = torch.isin(next_B, self._eos_E)
        end = self.prompt_length + self.steps
        for sequence_N in self._sequences:
            if self.steps >= len(sequence_N):
                stops_B |= (self.tokens_BL[:, end - len(sequence_N) : end] == sequence_N).all(dim=1)
        return stops_B & ~self.finished_B

    def result(self) -> Tensor:
        """``[B, S + steps]``: the prompts and every token generated so far (a view of the output buffer)."""
        return self.tokens_BL[:, : self.prompt_length + self.steps]


@torch.inference_mode()
def generate(
    model: CausalLM,
    input_ids_BS: Tensor,
    max_new_tokens: int,
    *,
    attention_mask_BS: Tensor | None = None,
    sampling: SamplingConfig | None = None,
    eos_token_ids: Sequence[int] | None = None,
    stop_sequences: Sequence[Sequence[int]] = (),
    pad_token_id: int | None = None,
    stop_early: bool = True,
) -> Tensor:
    """``[B, S + n]``: the prompts followed by up to ``max_new_tokens`` tokens (greedy unless ``sampling`` says).

    ``eos_token_ids`` defaults to the model config's. A sequence that produced one of them (or ended
    with a stop sequence) is finished: later positions get ``pad_token_id`` (default: the config's,
    else the first eos id), and generation stops early once every sequence is finished. Pass ``()``
    to never stop. ``stop_early=False`` runs all ``max_new_tokens`` steps anyway: ranks whose
    collectives must stay in step (FSDP, expert dispatch) cannot stop at different times.
    """
    stop = stop_rules(model.config, eos_token_ids, stop_sequences, pad_token_id)
    generation = Generation(
        model, input_ids_BS, max_new_tokens, attention_mask_BS=attention_mask_BS, sampling=sampling, stop=stop
    )
    while generation.steps < max_new_tokens:
        generation.step()
        if stop_early and generation.done:
            break
    return generation.result().contiguous()


def stop_rules(
    config: ModelConfig,
    eos_token_ids: Sequence[int] | None = None,
    stop_sequences: Sequence[Sequence[int]] = (),
    pad_token_id: int | None = None,
) -> StopRules:
    """The stop rules of a request: ``eos_token_ids`` default to the config's; the pad id see :func:`pad_token_for`."""
    eos = tuple(config.eos_token_ids if eos_token_ids is None else eos_token_ids)
    sequences = tuple(tuple(sequence) for sequence in stop_sequences)
    return StopRules(eos, sequences, pad_token_for(config, eos, pad_token_id))


def pad_token_for(config: ModelConfig, eos: tuple[int, ...], pad_token_id: int | None) -> int:
    """The id written after a sequence finished: the given one, the config's, else the first eos id."""
    if pad_token_id is not None:
        return pad_token_id
    if config.pad_token_id is not None:
        return config.pad_token_id
    return eos[0] if eos else 0  # without eos no sequence finishes, so the pad value is never used


def trim_finished(tokens_BL: Tensor, prompt_length: int, lengths_B: Tensor) -> Tensor:
    """Drop the trailing steps after every row finished (what stopping early would have left).

    ``lengths_B``: tokens each row generated up to its stop token, -1 for a row that never stopped.
    """
    if lengths_B.numel() == 0 or bool((lengths_B < 0).any()):
        return tokens_BL
    return tokens_BL[:, : prompt_length + int(lengths_B.max())]


# Steps whose sampling numbers are drawn together (one host -> device copy per block).
UNIFORM_BLOCK = 32

# Odd 64-bit constants (splitmix64's) that spread (seed, row, step) over distinct generator seeds.
_MIX = (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
