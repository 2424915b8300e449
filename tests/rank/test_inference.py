"""Inference as users call it through the handle (issue 21): prompts of different lengths, any number of rows on
any layout, sampling that repeats across layouts, streaming, last-position logits, bad input on the driver."""

import pytest
import torch

MOE = "moe_e8_k2_mha"
GPT_OSS = "gptoss_e4_k3_gqa2_window5"
LAYOUTS = {"one-rank": {}, "tp2-fsdp2-ep2": {"tp_size": 2, "fsdp_size": 2, "ep_size": 2}}
SAMPLING = {"do_sample": True, "temperature": 0.9, "top_k": 40, "top_p": 0.95, "seed": 7}


def ragged_prompts(vocab, lengths=(5, 9, 13), seed=2):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=gen).tolist() for n in lengths]


def transformers_continuations(hf_model, prompts, max_new_tokens, pad=0):
    """transformers' greedy ``generate`` on the left-padded batch, each row cut back to prompt + continuation."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = hf_model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad)
    eos_ids = hf_model.generation_config.eos_token_id
    eos = set(eos_ids) if isinstance(eos_ids, list) else {eos_ids} - {None}
    rows = []
    for p, row in zip(prompts, out.tolist(), strict=True):
        new = row[width:]
        stop = next((i + 1 for i, t in enumerate(new) if t in eos), len(new))
        rows.append(p + new[:stop])
    return rows


@pytest.mark.parametrize("name", [MOE, GPT_OSS])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_prompts_of_different_lengths_continue_as_in_transformers(
    name, layout, load_on_world, tiny_checkpoint, load_hf_model
):
    directory = tiny_checkpoint(name)
    hf_model = load_hf_model(directory)
    prompts = ragged_prompts(hf_model.config.vocab_size)
    expected = transformers_continuations(hf_model, prompts, 8)
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = (torch.arange(width)[None, :] >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()
    expected_tensor = hf_model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    with load_on_world(directory, LAYOUTS[layout]) as model:
        assert model.generate(prompts, 8, pad_token_id=0) == expected
        assert torch.equal(model.generate(ids, 8, attention_mask=mask, pad_token_id=0), expected_tensor)
        assert model.generate(prompts[1:2], 8) == expected[1:2]  # one prompt: three data-parallel batches idle
        streamed = [list(p) for p in prompts]
        for step in model.generate_stream(prompts, 8, pad_token_id=0):
            for row, token in zip(streamed, step, strict=True):
                if token is not None:
                    row.append(token)
        assert streamed == expected


def test_sampling_repeats_across_layouts_and_seeds_differ(load_on_world, tiny_checkpoint):
    directory = tiny_checkpoint(MOE)
    prompts = ragged_prompts(96, lengths=(4, 7, 3, 6, 5))
    outputs = {}
    for layout, config in LAYOUTS.items():
        with load_on_world(directory, config) as model:
            outputs[layout] = model.generate(prompts, 10, eos_token_ids=(), **SAMPLING)
            if layout == "one-rank":
                other_seed = model.generate(prompts, 10, eos_token_ids=(), **{**SAMPLING, "seed": 8})
                greedy = model.generate(prompts, 10, eos_token_ids=())
                cold = model.generate(prompts, 10, eos_token_ids=(), **{**SAMPLING, "temperature": 0.0})
    assert outputs["one-rank"] == outputs["tp2-fsdp2-ep2"]
    assert outputs["one-rank"] != other_seed and outputs["one-rank"] != greedy
    assert cold == greedy


def test_any_row_count_and_last_logits(load_on_world, tiny_checkpoint, load_hf_model):
    """fsdp4/ep4: four data-parallel batches for 1, 3 or 6 rows; logits of the last real token only."""
    directory = tiny_checkpoint(MOE)
    hf_model = load_hf_model(directory)
    ids = torch.randint(0, 96, (6, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0  # right-padded row: its last real token is position 5
    with torch.no_grad():
        expected = hf_model(input_ids=ids, attention_mask=mask).logits
    with load_on_world(directory, {"fsdp_size": 4, "ep_size": 4}) as model:
        for rows in (1, 3, 6):
            got = model(ids[:rows], attention_mask=mask[:rows])
            assert got.shape == (rows, 9, 96)
            assert (got - expected[:rows])[mask[:rows].bool()].abs().max().item() <= 1e-5
        last = model(ids, attention_mask=mask, return_logits="last")
        positions = torch.tensor([8, 5, 8, 8, 8, 8])
        assert last.shape == (6, 96)
        assert (last - expected[torch.arange(6), positions]).abs().max().item() <= 1e-5


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda m: m.generate([[]], 4), r"prompt 0 is empty"),
        (lambda m: m.generate([], 4), r"non-empty list of token-id lists"),
        (lambda m: m.generate([[1, 2, 96]], 4), r"prompt 0 has \[96\]: token ids must be ints in \[0, 96\)"),
        (lambda m: m.generate(torch.tensor([[1, -1]]), 4), r"prompts must be token ids in \[0, 96\)"),
        (lambda m: m.generate([[1, 2]], 255), r"sequence length 257 exceeds the model's max_position_embeddings=256"),
        (
            lambda m: m.generate([[1, 2]], 4, do_sample=True, temperature=-1.0),
            r"temperature=-1.0 must be a number >= 0",
        ),
        (lambda m: m.generate([[1, 2]], 4, do_sample=True, top_p=0.0), r"top_p=0.0 must be in \(0, 1\]"),
        (lambda m: m.generate([[1, 2]], 4, do_sample=True, top_p=1.01), r"top_p=1.01 must be in \(0, 1\]"),
        (lambda m: m.generate([[1, 2]], -1), r"max_new_tokens must be an int >= 0, got -1"),
        (lambda m: m.generate([[1, 2]], 4, stop_sequences=[[]]), r"stop_sequences\[0\] is empty"),
        (
            lambda m: m.generate(torch.tensor([[1, 2, 3]]), 4, attention_mask=torch.tensor([[1, 1, 0]])),
            r"padding after real tokens; pad prompts on the left",
        ),
        (lambda m: m(torch.tensor([[1, 2]]), return_logits="first"), r"return_logits='first'"),
        (lambda m: list(m.generate_stream([[]], 4)), r"prompt 0 is empty"),
    ],
)
def test_bad_input_fails_on_the_driver_before_any_rank_call(call, message, load_on_world, tiny_checkpoint, monkeypatch):
    with load_on_world(tiny_checkpoint(MOE), {"fsdp_size": 2, "ep_size": 2}) as model:
        calls = []
        for method in ("execute", "execute_per_rank"):
            monkeypatch.setattr(model._lease.group(), method, lambda *args, **kwargs: calls.append(args))
        with pytest.raises(ValueError, match=message):
            call(model)
        assert calls == []
        monkeypatch.undo()


def fsdp_gathers(ctx, max_new_tokens, stream):
    """``(FSDP all-gathers while this rank generates, or streams, max_new_tokens tokens; every parameter group's
    reshard-after-forward setting before and after)``."""
    from torch.distributed.fsdp import FSDPModule
    from torch.utils._python_dispatch import TorchDispatchMode

    from raymoe.models.common.generation import SamplingConfig, StopRules
    from raymoe.rank.contract import DecodeRequest
    from raymoe.rank.infer import end_stream, generate_tokens, start_stream, stream_step

    class Gathers(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += func is torch.ops.fsdp.all_gather_copy_in.default  # one per unit gathered
            return func(*args, **(kwargs or {}))

    def settings():
        units = [m for m in ctx.require_model().model.modules() if isinstance(m, FSDPModule)]
        return [group._reshard_after_forward for unit in units for group in unit._get_fsdp_state()._fsdp_param_groups]

    before = settings()
    ids, rows = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]]), torch.arange(2)
    request = DecodeRequest(max_new_tokens, SamplingConfig(), StopRules())
    with Gathers() as gathers:
        if stream:
            start_stream(ctx, ids, None, rows, request)
            for _ in range(max_new_tokens):
                stream_step(ctx)
            end_stream(ctx)
        else:
            generate_tokens(ctx, ids, None, rows, request)
    return gathers.count, before, settings()


def test_fsdp_gathers_once_per_generation_and_training_after_is_unchanged(load_on_world, tiny_checkpoint):
    """fsdp2: each unit is gathered once for a whole generation (or stream), not once per token; afterwards every
    unit reshards after forward as before, and training steps equal those of a model that never generated."""
    directory = tiny_checkpoint(MOE)
    ids = torch.randint(1, 96, (4, 8), generator=torch.Generator().manual_seed(3))
    config = {"fsdp_size": 2, "fsdp_reshard_after_forward": "always"}  # units that reshard, to be restored
    with load_on_world(directory, config) as model:
        model.configure_training(lr=1e-3)
        fresh = [model.train_step(ids) for _ in range(2)]
    with load_on_world(directory, config) as model:
        model.configure_training(lr=1e-3)
        counted = {(n, stream): model.run_on_ranks(fsdp_gathers, n, stream) for n in (1, 8) for stream in (False, True)}
        model.generate(ids[:2].tolist(), 8, eos_token_ids=())
        after = [model.train_step(ids) for _ in range(2)]
    for got, want in zip(after, fresh, strict=True):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-6)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-6)
    for rank in range(2):
        gathers = {key: answers[rank][0] for key, answers in counted.items()}
        assert len(set(gathers.values())) == 1 and gathers[1, False] > 0, gathers
        for _, before, restored in (answers[rank] for answers in counted.values()):
            assert restored == before and any(before) and not all(before)  # the root keeps its weights
