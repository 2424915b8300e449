"""The decode sync budget (issue 36): a whole ``generate_tokens`` on one rank waits for the device at most once
per decoded token, a stream step exactly once (the token it answers), for a dense and an MoE model.

Counted with :class:`raymoe.rank.host_syncs.HostSyncs` on a world of one rank (``load_local``), sampling and stop
rules on. Outside the steps the call makes one more count: ``row_ids.tolist()`` when it starts, a read of a host
tensor that the CPU meter cannot tell from a device one (no wait on CUDA). The answer's copy to the host is the
last token's sync: ``done`` is not asked after the last step.
"""

import pytest
import torch

from raymoe.models.common.generation import SamplingConfig, StopRules
from raymoe.rank.contract import DecodeRequest
from raymoe.rank.host_syncs import HostSyncs
from raymoe.rank.infer import end_stream, generate_tokens, start_stream, stream_step

MODELS = ["llama_gqa2_llama3_rope_bias", "moe_e8_k2_mha"]  # dense; MoE with the default (masked, no EP) layout
PROMPT = torch.tensor([[0, 0, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14], [0, 3, 4, 5, 6, 7]])  # left-padded
MASK = (PROMPT != 0).long()
SAMPLING = SamplingConfig(do_sample=True, temperature=0.9, top_k=40, top_p=0.95, seed=7)
# eos and stop sequences the tiny models rarely produce, so the rows run (and are checked) every step
STOP = StopRules(eos_ids=(95,), stop_sequences=((3, 4), (5, 6, 7)), pad_id=0)
START_READS = 1  # row_ids.tolist(): a host tensor, counted by the CPU meter


def counted_generation(ctx, max_new_tokens):
    """``(syncs, tokens decoded, sync sites)`` of one ``generate_tokens`` of the three prompts."""
    request = DecodeRequest(max_new_tokens, SAMPLING, STOP)
    with HostSyncs() as syncs:
        tokens, _ = generate_tokens(ctx, PROMPT, MASK, torch.arange(3), request)
    return syncs.count, tokens.shape[1] - PROMPT.shape[1], dict(syncs.sites)


def counted_stream(ctx, steps):
    """The syncs of each ``stream_step``."""
    start_stream(ctx, PROMPT, MASK, torch.arange(3), DecodeRequest(steps, SAMPLING, STOP))
    counts = []
    for _ in range(steps):
        with HostSyncs() as syncs:
            stream_step(ctx)
        counts.append((syncs.count, dict(syncs.sites)))
    end_stream(ctx)
    return counts


@pytest.mark.parametrize("name", MODELS)
def test_a_generation_waits_for_the_device_at_most_once_per_token(name, load_local, tiny_checkpoint):
    with load_local(tiny_checkpoint(name)) as model:
        for max_new_tokens in (1, 12):
            [(syncs, decoded, sites)] = model.run_on_ranks(counted_generation, max_new_tokens)
            assert decoded >= min(max_new_tokens, 4), "the rows should run long enough to count"
            assert syncs <= decoded + START_READS, sites


@pytest.mark.parametrize("name", MODELS)
def test_a_stream_step_waits_once_for_the_token_it_answers(name, load_local, tiny_checkpoint):
    with load_local(tiny_checkpoint(name)) as model:
        [counts] = model.run_on_ranks(counted_stream, 6)
        assert [count for count, _ in counts] == [1] * 6, counts
