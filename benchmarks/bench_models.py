"""Single-process training throughput of raymoe's Qwen3-MoE against transformers' (CPU-sized shape).

One training step = forward, next-token loss, backward, AdamW step. All variants start from the
same weights (a transformers-initialised checkpoint in a temp dir) and see the same batch.
Steps of the variants are interleaved round by round, so a noisy machine slows them alike;
the table reports the median step.

    .venv/bin/python benchmarks/bench_models.py            # defaults below
    .venv/bin/python benchmarks/bench_models.py --steps 10 --batch 8 --seq 256 --threads 2

Needs the test extra (transformers); not run by the test suite.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import transformers
from _model_shape import add_shape_args, save_checkpoint

from raymoe.checkpoint import load_model
from raymoe.models import causal_lm_loss
from raymoe.models.moe import GemmBackend, GroupedExperts

Step = Callable[[], float]  # runs one training step, returns its loss


def _raymoe_step(directory: Path, backend: GemmBackend, input_ids: torch.Tensor, dtype: torch.dtype) -> Step:
    model = load_model(directory, dtype=dtype).train()
    for module in model.modules():
        if isinstance(module, GroupedExperts):
            module.gemm_backend = backend
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> float:
        loss = causal_lm_loss(model(input_ids), input_ids)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    return step


def _transformers_step(directory: Path, experts: str, input_ids: torch.Tensor, dtype: torch.dtype) -> Step:
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, experts_implementation=experts)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> float:
        loss = model(input_ids, labels=input_ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss.item())

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6, help="timed steps per variant (after 2 warm-up steps)")
    add_shape_args(parser, heads=8, kv_heads=2)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)

    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        save_checkpoint(directory, args)
        torch.manual_seed(0)
        input_ids = torch.randint(0, args.vocab, (args.batch, args.seq))
        variants: dict[str, Step] = {
            "raymoe (auto -> torch._grouped_mm)": _raymoe_step(directory, "auto", input_ids, dtype),
            "raymoe (padded bmm)": _raymoe_step(directory, "padded", input_ids, dtype),
            "transformers (experts eager)": _transformers_step(directory, "eager", input_ids, dtype),
            "transformers (experts grouped_mm)": _transformers_step(directory, "grouped_mm", input_ids, dtype),
        }
        timings = _run(variants, args.steps)

    tokens = args.batch * args.seq
    print(
        f"Qwen3-MoE train step, {args.dtype}, {torch.get_num_threads()} threads: hidden {args.hidden}, "
        f"{args.layers} layers, {args.experts} experts top-{args.top_k}, moe_intermediate {args.moe_intermediate}, "
        f"vocab {args.vocab}, batch {args.batch} x seq {args.seq} = {tokens} tokens/step, median of {args.steps}"
    )
    print(f"| {'variant':36s} | step ms | tokens/s |")
    print(f"|{'-' * 38}|--------:|---------:|")
    for name, seconds in timings.items():
        median = statistics.median(seconds)
        print(f"| {name:36s} | {median * 1e3:7.0f} | {tokens / median:8.0f} |")


def _run(variants: dict[str, Step], steps: int) -> dict[str, list[float]]:
    for step in variants.values():  # warm-up: allocator, thread pools, lazy inits
        step()
        step()
    timings: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(steps):
        for name, step in variants.items():
            start = time.perf_counter()
            step()
            timings[name].append(time.perf_counter() - start)
    return timings


if __name__ == "__main__":
    main()
