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

from raymoe.models.common.loss import IGNORE_INDEX


def next_token_logprobs(logits_BSV: Tensor, input_ids_BS: Tensor, temperature: float = 1.0) -> Tensor:
    """``[B, S]`` float32 log-probability of each token given the ones before it, aligned with ``input_ids``."""
    targets_BS = F.pad(input_ids_BS[:, 1:], (0, 1), value=IGNORE_INDEX)  # position t predicts token t + 1
    scaled_BSV = _scaled(logits_BSV, temperature)
    rows, width = input_ids_BS.shape
    nll_N = F.cross_entropy(
        scaled_BSV.reshape(-1, scaled_BSV.shape[-1]),
        targets_BS.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="none",
    )
    return F.pad(-nll_N.view(rows, width)[:, :-1], (1, 0))


def next_token_entropy(logits_BSV: Tensor, temperature: float = 1.0) -> Tensor:
    """``[B, S]`` float32 entropy of the distribution each token was drawn from, aligned with the tokens."""
    logp_BSV = F.log_softmax(_scaled(logits_BSV, temperature), dim=-1)
    entropy_BS = -(logp_BSV.exp() * logp_BSV).sum(dim=-1)
    return F.pad(entropy_BS[:, :-1], (1, 0))


def _scaled(logits_BSV: Tensor, temperature: float) -> Tensor:
    logits_BSV = logits_BSV.float()
    return logits_BSV if temperature == 1.0 else logits_BSV / temperature
