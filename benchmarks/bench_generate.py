"""Generation speed (issue 21): time to first token and decode tokens/s, raymoe against transformers ``generate``.

The embedded demo model (``raymoe.build_tiny_checkpoint``: Qwen3-MoE, 8 experts), greedy, eos off,
prompts of ``--prompt-len`` tokens, batch 1 and 8 (``--batches``). Rows, all in one run:

    transformers       ``model.generate`` in this process (eager experts loop)
    raymoe 1-proc      ``raymoe.models.common.generation.generate`` in this process
    raymoe 1 rank      ``DistributedModel.generate`` on one rank actor (adds the Ray round trip)
    raymoe tp2         the same on two ranks, tp_size=2 (gloo all-reduces every layer)

Time to first token (TTFT) is a generation of one new token; decode tokens/s is
``batch * (n - 1) / (time(n tokens) - TTFT)``, both times the best (shortest) over ``--rounds``
rounds in which the variants alternate. On this 2-core CPU machine the absolute numbers are small and noisy:
compare the ratios of one run.

    .venv/bin/python benchmarks/bench_generate.py [--rounds 3] [--new-tokens 32] [--batches 1 8]

``--per-token`` (issue 36) instead times every step of one long in-process ``Generation`` (``--long-tokens``
256, sampling on, eos ids and two stop sequences) and prints ms/token early (tokens 2-17: token 1 is the
prefill) against late (the last 16), each the median over its tokens, best of ``--rounds``. A step whose work
grows with the tokens already generated shows as a late/early ratio above 1; attention over a longer cache
grows a little anyway.

    .venv/bin/python benchmarks/bench_generate.py --per-token [--long-tokens 256] [--batches 1 8]

Not run by the test suite.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

import raymoe
from raymoe.checkpoint import load_model
from raymoe.models.common.generation import Generation, SamplingConfig, StopRules, generate

Generate = Callable[[torch.Tensor, int], object]


def timed(fn: Generate, ids: torch.Tensor, new_tokens: int) -> float:
    began = time.perf_counter()
    fn(ids, new_tokens)
    return time.perf_counter() - began


def measure(fn: Generate, ids: torch.Tensor, new_tokens: int) -> tuple[float, float]:
    """``(seconds for one new token, seconds for new_tokens)`` of one round."""
    return timed(fn, ids, 1), timed(fn, ids, new_tokens)


def step_times(model: torch.nn.Module, ids: torch.Tensor, new_tokens: int) -> list[float]:
    """Seconds of each step of one generation (the first step is the prefill)."""
    sampling = SamplingConfig(do_sample=True, temperature=0.9, top_k=40, top_p=0.95, seed=1)
    stop = StopRules(eos_ids=(1, 2), stop_sequences=((3, 4), (5, 6, 7)), pad_id=0)  # rows keep stepping after
    generation = Generation(model, ids, new_tokens, sampling=sampling, stop=stop)
    times = []
    with torch.no_grad():
        for _ in range(new_tokens):
            began = time.perf_counter()
            generation.step()
            times.append(time.perf_counter() - began)
    return times


def per_token(args: argparse.Namespace) -> None:
    """ms/token early and late in one long generation, in this process."""
    window = 16
    with tempfile.TemporaryDirectory() as tmp:
        model = load_model(raymoe.build_tiny_checkpoint(Path(tmp) / "tiny")).eval()
    print(f"prompt {args.prompt_len} tokens, {args.long_tokens} new tokens, best of {args.rounds} rounds")
    late_first = args.long_tokens - window + 1
    print(f"{'batch':>5}  {'ms/token 2-17':>14} {f'ms/token {late_first}-{args.long_tokens}':>18} {'late/early':>11}")
    for batch in args.batches:
        ids = torch.randint(8, 256, (batch, args.prompt_len), generator=torch.Generator().manual_seed(batch))
        early, late = float("inf"), float("inf")
        for _ in range(args.rounds):
            times = step_times(model, ids, args.long_tokens)
            early = min(early, statistics.median(times[1 : 1 + window]))
            late = min(late, statistics.median(times[-window:]))
        print(f"{batch:>5}  {early * 1e3:>14.2f} {late * 1e3:>18.2f} {late / early:>10.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--per-token", action="store_true", help="ms/token early vs late in one long generation")
    parser.add_argument("--long-tokens", type=int, default=256)
    args = parser.parse_args()
    torch.set_num_threads(1)  # the rank actors get one CPU each; the in-process rows get the same
    if args.per_token:
        per_token(args)
        return

    import transformers

    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = raymoe.build_tiny_checkpoint(Path(tmp) / "tiny")
        reference = transformers.AutoModelForCausalLM.from_pretrained(
            checkpoint, dtype=torch.float32, experts_implementation="eager"
        ).eval()
        ours = load_model(checkpoint).eval()
        variants: dict[str, Generate] = {
            "transformers": lambda ids, n: reference.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False
            ),
            "raymoe 1-proc": lambda ids, n: generate(ours, ids, n, eos_token_ids=()),
        }
        worlds = {"raymoe 1 rank": ({}, 1), "raymoe tp2": ({"tp_size": 2}, 2)}
        handles = {}
        for name, (layout, size) in worlds.items():
            world = raymoe.start_world(size, cpus_per_rank=0.5)  # both worlds fit a 2-CPU machine
            handles[name] = (world, raymoe.from_pretrained(checkpoint, distributed_config=layout, world=world))
            model = handles[name][1]
            variants[name] = lambda ids, n, model=model: model.generate(ids, n, eos_token_ids=())
        try:
            print(f"prompt {args.prompt_len} tokens, {args.new_tokens} new tokens, best of {args.rounds} rounds")
            print(f"{'batch':>5}  {'variant':<15} {'TTFT ms':>9} {'decode tok/s':>13} {'vs transformers':>16}")
            for batch in args.batches:
                ids = torch.randint(0, 256, (batch, args.prompt_len), generator=torch.Generator().manual_seed(batch))
                best = {name: (float("inf"), float("inf")) for name in variants}
                names = list(variants)
                for round_index in range(args.rounds):
                    for name in names[round_index % len(names) :] + names[: round_index % len(names)]:
                        first, whole = measure(variants[name], ids, args.new_tokens)
                        best[name] = (min(best[name][0], first), min(best[name][1], whole))
                rates = {name: batch * (args.new_tokens - 1) / (whole - first) for name, (first, whole) in best.items()}
                for name, (first, _) in best.items():
                    ratio = rates[name] / rates["transformers"]
                    print(f"{batch:>5}  {name:<15} {first * 1e3:>9.1f} {rates[name]:>13.0f} {ratio:>15.2f}x")
        finally:
            for world, model in handles.values():
                model.shutdown()
                world.shutdown()


if __name__ == "__main__":
    main()
