"""KV cache and generation: cached decoding equals full recomputation; eos and stop sequences; left-padded
prompts against transformers; sampling (limits, seeds across row splits, top-k / top-p sets); a step's work
that does not grow with the tokens already generated."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from raymoe.checkpoint import load_model
from raymoe.models import KVCache
from raymoe.models.common.generation import UNIFORM_BLOCK, Generation, SamplingConfig, StopRules, generate, pick_next


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


# --- prompts of different lengths (left padding) ------------------------------------------------

PADDED_MODELS = ["moe_e5_k3_gqa2_dense_mid", "gptoss_e4_k3_gqa2_window5", "llama_gqa2_llama3_rope_bias"]


def left_padded(vocab: int, lengths=(5, 9, 13), pad: int = 0, seed: int = 2):
    """Prompts of ``lengths`` tokens, left-padded with ``pad`` to the longest: ``(ids, mask, rows)``."""
    gen = torch.Generator().manual_seed(seed)
    rows = [torch.randint(1, vocab, (n,), generator=gen).tolist() for n in lengths]
    width = max(lengths)
    ids = torch.full((len(rows), width), pad)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :] = torch.tensor(row)
        mask[i, width - len(row) :] = 1
    return ids, mask, rows


@pytest.mark.parametrize("name", PADDED_MODELS)
def test_left_padded_prompts_generate_like_transformers(name, tiny_checkpoint, load_hf_model):
    directory = tiny_checkpoint(name)
    ours, reference = load_model(directory), load_hf_model(directory)
    ids, mask, _ = left_padded(ours.config.vocab_size)
    expected = reference.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(generate(ours, ids, 8, attention_mask_BS=mask, pad_token_id=0), expected)
    with torch.no_grad():  # and the logits of every real position
        real = mask.bool()
        diff = (ours(ids, attention_mask_BS=mask) - reference(input_ids=ids, attention_mask=mask).logits)[real]
        assert diff.abs().max().item() <= 1e-5


def test_a_padded_row_continues_as_it_would_alone(tiny_checkpoint):
    model = load_model(tiny_checkpoint("gptoss_e4_k3_gqa2_window5"))
    ids, mask, rows = left_padded(model.config.vocab_size)
    batched = generate(model, ids, 6, attention_mask_BS=mask, eos_token_ids=())
    for i, row in enumerate(rows):
        alone = generate(model, torch.tensor([row]), 6, eos_token_ids=())
        assert torch.equal(batched[i, -6:], alone[0, -6:])


# --- sampling -----------------------------------------------------------------------------------


def sampled(model, ids, **options):
    return generate(model, ids, 8, sampling=SamplingConfig(**options), eos_token_ids=())


def test_sampling_limits_equal_greedy_and_a_seed_repeats(tiny_checkpoint):
    model = load_model(tiny_checkpoint("moe_e8_k2_mha"))
    ids = torch.randint(0, model.config.vocab_size, (3, 5), generator=torch.Generator().manual_seed(4))
    greedy = generate(model, ids, 8, eos_token_ids=())
    assert torch.equal(sampled(model, ids, do_sample=True, temperature=0.0, seed=1), greedy)
    assert torch.equal(sampled(model, ids, do_sample=True, top_k=1, seed=1), greedy)
    first = sampled(model, ids, do_sample=True, temperature=1.5, seed=1)
    assert torch.equal(sampled(model, ids, do_sample=True, temperature=1.5, seed=1), first)
    assert not torch.equal(first, greedy) and not torch.equal(sampled(model, ids, do_sample=True, seed=2), first)


def test_a_seed_gives_each_global_row_the_same_tokens_however_rows_are_split(tiny_checkpoint):
    """Ranks decode blocks of the global batch: row r draws the numbers of global row r, wherever it runs."""
    model = load_model(tiny_checkpoint("moe_e8_k2_mha"))
    ids = torch.randint(0, model.config.vocab_size, (4, 5), generator=torch.Generator().manual_seed(5))
    options = SamplingConfig(do_sample=True, temperature=1.2, top_p=0.9, seed=11)
    whole = Generation(model, ids, 6, sampling=options)
    parts = [Generation(model, ids[rows], 6, sampling=options, row_ids=rows) for rows in ([0], [1, 2, 3])]
    with torch.no_grad():
        for _ in range(6):
            expected = whole.step()
            assert torch.equal(torch.cat([part.step() for part in parts]), expected)


def test_top_k_and_top_p_never_sample_outside_their_sets():
    probs = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    logits = probs.log().expand(4000, -1)
    uniform = torch.rand(4000, generator=torch.Generator().manual_seed(0))
    nucleus = pick_next(logits, SamplingConfig(do_sample=True, top_p=0.75), uniform)  # 0.4 + 0.25 < 0.75 <= + 0.15
    assert set(nucleus.tolist()) == {0, 1, 2}
    frequencies = torch.bincount(nucleus, minlength=6)[:3].float() / 4000
    assert torch.allclose(frequencies, probs[:3] / probs[:3].sum(), atol=0.03)  # renormalised inside the nucleus
    assert set(pick_next(logits, SamplingConfig(do_sample=True, top_k=2), uniform).tolist()) == {0, 1}
    assert set(pick_next(logits, SamplingConfig(do_sample=True, top_p=0.3), uniform).tolist()) == {0}
    everything = pick_next(logits, SamplingConfig(do_sample=True), uniform)
    assert set(everything.tolist()) == set(range(6))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"temperature": -0.5}, r"temperature=-0.5 must be a number >= 0"),
        ({"top_p": 0.0}, r"top_p=0.0 must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p=1.5 must be in \(0, 1\]"),
        ({"top_k": 0}, r"top_k=0 must be an int >= 1 or None"),
        ({"seed": 1.5}, r"seed=1.5 must be an int"),
    ],
)
def test_bad_sampling_options_name_the_field(options, message):
    with pytest.raises(ValueError, match=message):
        SamplingConfig(do_sample=True, **options)


def test_a_stop_sequence_finishes_its_row(tiny_checkpoint):
    model = load_model(tiny_checkpoint("llama_mha_tied_linear_rope"))
    prompt = torch.tensor([[5, 6, 7], [9, 10, 11]])
    free = generate(model, prompt, 8, eos_token_ids=())
    generated = free[0, 3:].tolist()
    stop = generated[2:4]  # the 3rd and 4th tokens row 0 generates; the row ends where they first appear
    end = 3 + next(i for i in range(len(generated)) if generated[i : i + 2] == stop) + 2
    out = generate(model, prompt, 8, eos_token_ids=(), stop_sequences=[stop], pad_token_id=0)
    assert torch.equal(out[0, :end], free[0, :end]) and (out[0, end:] == 0).all()


# --- a step's work does not grow with the tokens already generated (issue 36) ---------------------


class Work(TorchDispatchMode):
    """Operators dispatched and the elements of their tensor arguments (what they read): the model's forward
    (``in_model``) apart from the generation's own work."""

    def __init__(self) -> None:
        super().__init__()
        self.counts = {False: [0, 0], True: [0, 0]}  # in_model -> [operators, elements read]
        self.in_model = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        counts = self.counts[self.in_model]
        counts[0] += 1
        counts[1] += sum(x.numel() for x in tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor))
        return func(*args, **(kwargs or {}))


class Counted:
    """The model, its forward counted apart (attention reads the whole cache: that work does grow)."""

    def __init__(self, model, work: Work) -> None:
        self.model, self.work = model, work

    def new_cache(self, max_length):
        return self.model.new_cache(max_length)

    def __call__(self, *args):
        self.work.in_model = True
        try:
            return self.model(*args)
        finally:
            self.work.in_model = False


def work_of_steps(model, steps: int, sampling: SamplingConfig, counted: set[int]) -> dict[int, Work]:
    """The work of the ``counted`` steps of a generation of ``steps`` with eos ids and stop sequences."""
    ids, mask, _ = left_padded(model.config.vocab_size)
    stop = StopRules(eos_ids=(3, 4), stop_sequences=((5, 6), (7, 8, 9)), pad_id=0)
    work = {step: Work() for step in counted}
    decoder = Counted(model, Work())
    generation = Generation(decoder, ids, steps, attention_mask_BS=mask, sampling=sampling, stop=stop)
    with torch.no_grad():
        for step in range(steps):
            if step in counted:
                decoder.work = work[step]
                with work[step]:
                    generation.step()
            else:
                generation.step()
    return work


@pytest.mark.parametrize("sampling", [SamplingConfig(), SamplingConfig(do_sample=True, top_k=20, top_p=0.9, seed=3)])
def test_a_step_does_the_same_work_late_in_a_generation_as_early(sampling, tiny_checkpoint):
    """Step 5 and step 5 + 2 blocks (and two blocks' first steps, which draw the block's sampling numbers): the
    same operators reading the same number of elements outside the model; the same operators in the model."""
    model = load_model(tiny_checkpoint("moe_e8_k2_mha"))
    early, late = 5, 5 + 2 * UNIFORM_BLOCK
    work = work_of_steps(model, 3 * UNIFORM_BLOCK, sampling, {early, late, UNIFORM_BLOCK, 2 * UNIFORM_BLOCK})
    assert work[early].counts[False] == work[late].counts[False]
    assert work[UNIFORM_BLOCK].counts[False] == work[2 * UNIFORM_BLOCK].counts[False]
    assert work[early].counts[True][0] == work[late].counts[True][0]
