"""KV cache and greedy generation: cached decoding equals full recomputation; eos handling."""

from __future__ import annotations

import pytest
import torch

from raymoe.checkpoint import load_model
from raymoe.models import KVCache
from raymoe.models.common.generation import generate


def test_cached_chunks_equal_one_full_forward(tiny_name, tiny_checkpoint):
    """Prefill, a multi-token chunk on top of the cache, then single tokens: the logits of one pass."""
    model = load_model(tiny_checkpoint(tiny_name))
    input_ids = torch.randint(0, model.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(input_ids)
        cache = KVCache(len(model.model.layers), max_length=11)
        pieces = [model(input_ids[:, :4], cache), model(input_ids[:, 4:9], cache)]
        pieces += [model(input_ids[:, t : t + 1], cache) for t in range(9, 11)]
    assert cache.length == 11
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-5, atol=1e-5)


def test_eos_finishes_a_sequence_and_pads_it(tiny_checkpoint):
    model = load_model(tiny_checkpoint("moe_e8_k2_mha"))
    prompts = torch.randint(0, model.config.vocab_size, (2, 4), generator=torch.Generator().manual_seed(1))
    free = generate(model, prompts, max_new_tokens=6, eos_token_ids=())
    eos = int(free[0, 5])  # the second token sequence 0 generates
    pad = model.config.vocab_size - 1
    out = generate(model, prompts, max_new_tokens=6, eos_token_ids=[eos], pad_token_id=pad)
    assert torch.equal(out[0, :6], free[0, :6]) and (out[0, 6:] == pad).all()
    row1_stop = next((i for i in range(4, free.shape[1]) if free[1, i] == eos), None)
    if row1_stop is None:
        assert torch.equal(out[1], free[1])
    else:
        assert torch.equal(out[1, : row1_stop + 1], free[1, : row1_stop + 1])


def test_generation_stops_when_every_sequence_finished(tiny_checkpoint):
    model = load_model(tiny_checkpoint("llama_mha_tied_linear_rope"))
    prompt = torch.tensor([[5, 6, 7]])
    first = int(generate(model, prompt, max_new_tokens=1, eos_token_ids=())[0, -1])
    assert generate(model, prompt, max_new_tokens=10, eos_token_ids=[first]).shape == (1, 4)
    assert torch.equal(generate(model, prompt, max_new_tokens=0), prompt)


def test_cache_overflow_is_an_error(tiny_checkpoint):
    model = load_model(tiny_checkpoint("qwen3_gqa4_tied"))
    cache = KVCache(len(model.model.layers), max_length=3)
    with pytest.raises(ValueError, match=r"KV cache overflow: writing positions 0\.\.4 into a cache of 3"):
        model(torch.tensor([[1, 2, 3, 4]]), cache)
