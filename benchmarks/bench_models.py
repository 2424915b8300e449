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

from raymoe.checkpoint import load_model
from raymoe.models import causal_lm_loss
from raymoe.models.moe import GemmBackend, GroupedExperts

Step = Callable[[], float]  # runs one training step, returns its loss


def _config(args: argparse.Namespace) -> transformers.Qwen3MoeConfig:
    return transformers.Qwen3MoeConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        moe_intermediate_size=args.moe_intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        norm_topk_prob=True,
    )


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
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--moe-intermediate", type=int, default=128)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)

    torch.manual_seed(0)
    input_ids = torch.randint(0, args.vocab, (args.batch, args.seq))
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        transformers.AutoModelForCausalLM.from_config(_config(args)).save_pretrained(directory)
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
