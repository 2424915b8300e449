"""Single-process greedy generation with a KV cache.

The prompt is run once (prefill) to fill the cache; each further step runs only the newest
token. The head is applied to the last position only, so no ``[B, S, vocab]`` logits are built.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from raymoe.models.common.config import ModelConfig
from raymoe.models.common.decoder import CausalLM
from raymoe.models.common.kv_cache import KVCache


@torch.inference_mode()
def generate(
    model: CausalLM,
    input_ids_BS: Tensor,
    max_new_tokens: int,
    *,
    eos_token_ids: Sequence[int] | None = None,
    pad_token_id: int | None = None,
    stop_early: bool = True,
) -> Tensor:
    """``[B, S + n]``: the prompts followed by up to ``max_new_tokens`` greedy (argmax) tokens.

    ``eos_token_ids`` defaults to the model config's. A sequence that produced one of them is
    finished: later positions get ``pad_token_id`` (default: the config's, else the first eos
    id), and generation stops early once every sequence is finished. Pass ``()`` to never stop.
    ``stop_early=False`` runs all ``max_new_tokens`` steps anyway: ranks whose collectives must
    stay in step (FSDP, expert dispatch) cannot stop at different times.
    """
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    eos = tuple(model.config.eos_token_ids if eos_token_ids is None else eos_token_ids)
    pad = pad_token_for(model.config, eos, pad_token_id)
    batch, prompt_len = input_ids_BS.shape
    cache = KVCache(len(model.model.layers), prompt_len + max_new_tokens)
    eos_ids = torch.tensor(eos, dtype=input_ids_BS.dtype, device=input_ids_BS.device)
    finished_B = torch.zeros(batch, dtype=torch.bool, device=input_ids_BS.device)
    tokens = [input_ids_BS]
    step_input_BS = input_ids_BS
    for _ in range(max_new_tokens):
        hidden_BSH = model.model(step_input_BS, cache)
        next_B = model.lm_head(hidden_BSH[:, -1]).argmax(dim=-1)
        next_B = torch.where(finished_B, torch.full_like(next_B, pad), next_B)
        tokens.append(next_B[:, None])
        finished_B |= torch.isin(next_B, eos_ids)
        if stop_early and eos and bool(finished_B.all()):
            break
        step_input_BS = next_B[:, None]
    return torch.cat(tokens, dim=1)


def pad_token_for(config: ModelConfig, eos: tuple[int, ...], pad_token_id: int | None) -> int:
    """The id written after a sequence finished: the given one, the config's, else the first eos id."""
    if pad_token_id is not None:
        return pad_token_id
    if config.pad_token_id is not None:
        return config.pad_token_id
    return eos[0] if eos else 0  # without eos no sequence finishes, so the pad value is never used


def trim_finished(tokens_BL: Tensor, prompt_length: int, eos: Sequence[int]) -> Tensor:
    """Drop the trailing steps after every row produced an eos id (what stopping early would have left)."""
    if not eos or tokens_BL.shape[1] == prompt_length:
        return tokens_BL
    is_eos_BN = torch.isin(tokens_BL[:, prompt_length:], torch.tensor(list(eos), dtype=tokens_BL.dtype))
    if not bool(is_eos_BN.any(dim=1).all()):
        return tokens_BL
    last_needed = int(is_eos_BN.int().argmax(dim=1).max())  # the step at which the slowest row finished
    return tokens_BL[:, : prompt_length + last_needed + 1]
