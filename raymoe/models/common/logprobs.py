"""Per-token log-probabilities and entropies of a causal LM's own tokens (RL: policy ratios, KL, entropy bonus).

Shape legend: ``B`` rows, ``S`` tokens, ``V`` vocabulary. Everything is aligned with ``input_ids``::

    logits [B, S, V]  (position t predicts token t + 1)
    logprobs [B, S]   entry t = log softmax(logits[:, t - 1] / temperature)[input_ids[:, t]]; entry 0 = 0
    entropy [B, S]    entry t = the entropy of that distribution; entry 0 = 0

The logits may be a vocabulary-sharded DTensor inside ``raymoe.parallel.vocab_parallel.vocab_parallel_loss``:
each op below then runs shard-wise (torch's ``loss_parallel``), and no ``[B, S, V]`` tensor is gathered.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from raymoe.models.common.loss import IGNORE_INDEX, next_in_row


def next_token_logprobs(logits_BSV: Tensor, input_ids_BS: Tensor, temperature: float = 1.0) -> Tensor:
    """``[B, S]`` float32 log-probability of each token given the ones before it, aligned with ``input_ids``."""
    predicted_BS = target_logprobs(logits_BSV, next_in_row(input_ids_BS, IGNORE_INDEX), temperature)
    return to_token_alignment(predicted_BS)


def target_logprobs(logits_BSV: Tensor, targets_BS: Tensor, temperature: float = 1.0) -> Tensor:
    """``[B, S]`` float32: entry ``t`` is ``log softmax(logits[:, t] / temperature)[targets[:, t]]`` (0 where the
    target is ``IGNORE_INDEX``): aligned with the positions that predict, as a rank's share of the tokens is."""
    scaled_BSV = _scaled(logits_BSV, temperature)
    nll_N = F.cross_entropy(
        scaled_BSV.reshape(-1, scaled_BSV.shape[-1]),
        targets_BS.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="none",
    )
    return -nll_N.view(targets_BS.shape)


def next_token_entropy(logits_BSV: Tensor, temperature: float = 1.0) -> Tensor:
    """``[B, S]`` float32 entropy of the distribution each token was drawn from, aligned with the tokens."""
    return to_token_alignment(predicted_entropy(logits_BSV, temperature))


def predicted_entropy(logits_BSV: Tensor, temperature: float = 1.0) -> Tensor:
    """``[B, S]`` float32: entry ``t`` is the entropy of the distribution position ``t`` predicts from."""
    logp_BSV = F.log_softmax(_scaled(logits_BSV, temperature), dim=-1)
    return -(logp_BSV.exp() * logp_BSV).sum(dim=-1)


def to_token_alignment(predicted_BS: Tensor) -> Tensor:
    """Values aligned with the predicting positions (entry ``t`` about token ``t + 1``) -> aligned with the tokens
    (entry 0 = 0): the layout every log-prob answer has."""
    return F.pad(predicted_BS[:, :-1], (1, 0))


def _scaled(logits_BSV: Tensor, temperature: float) -> Tensor:
    logits_BSV = logits_BSV.float()
    return logits_BSV if temperature == 1.0 else logits_BSV / temperature
