"""The routed experts' two grouped GEMMs, forward and backward, per backend: what an MoE layer's matmuls can reach.

    .venv/bin/python benchmarks/bench_grouped_mm.py [--shapes few-large many-small] [--calls 10] [--dtype bfloat16]

For each named shape (``_model_shape.SHAPES``: its tokens, experts, top-k and widths), one batch of random routing
(uniform top-k, as a fresh router spreads tokens) and the expert-sorted rows ``x [S, H]`` (``S`` = tokens x top-k).
Timed, forward + backward (input and weight gradients) of ``gate_up [E, 2I, H]`` then ``down [E, H, I]``:

    grouped_mm   raymoe.models.moe.grouped_mm's ``torch._grouped_mm`` backend (what a CPU or bf16 CUDA rank runs)
    padded       its padded backend: every expert's rows in an ``[E, C, K]`` buffer, one batched matmul
                 (alone where torch._grouped_mm refuses the device and dtype: float32 on CUDA, where
                 ``--dtype bfloat16`` times the native kernel a CUDA rank computes in)
    one GEMM     the same FLOPs as two plain matmuls over all rows (``[S, H] x [H, 2I]``, ``[S, I] x [I, H]``):
                 what the work would cost if the experts were one weight, the ceiling of any grouped kernel

Calls alternate between the ways, the best of ``--calls`` is kept; GFLOP/s count the useful FLOPs
(``6 * S * 3 * H * I``: three matmuls each way) against the GEMM peak in ``--dtype`` (``bench_layouts.py``'s
measurement, taken first).
Not run by the test suite.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from _model_shape import SHAPES, Shape
from bench_layouts import matmul_peak_flops

from raymoe.models.moe.experts import tokens_per_expert
from raymoe.models.moe.grouped_mm import grouped_mm, select_gemm_backend


def expert_rows(shape: Shape, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [S, H]`` rows grouped by expert and ``counts [E]``: one batch routed uniformly at random (seed 0)."""
    gen = torch.Generator().manual_seed(0)
    tokens = shape.batch * shape.seq
    scores = torch.rand(tokens, shape.experts, generator=gen)
    topk_ids = scores.topk(shape.top_k, dim=-1).indices.to(device)
    counts = tokens_per_expert(topk_ids, shape.experts)
    return torch.randn(tokens * shape.top_k, shape.hidden, device=device, dtype=dtype), counts


def ways(shape: Shape, x: torch.Tensor, counts: torch.Tensor) -> dict[str, Callable[[], None]]:
    """Each way's forward + backward over the same rows (fresh leaves per call: no gradient accumulates)."""
    experts, hidden, inter = shape.experts, shape.hidden, shape.moe_intermediate
    gate_up = torch.randn(experts, 2 * inter, hidden, device=x.device, dtype=x.dtype) * hidden**-0.5
    down = torch.randn(experts, hidden, inter, device=x.device, dtype=x.dtype) * inter**-0.5
    grad_out = torch.randn(x.shape[0], hidden, device=x.device, dtype=x.dtype)

    def grouped(backend: str) -> Callable[[], None]:
        def call() -> None:
            xs, w1, w2 = (t.detach().requires_grad_() for t in (x, gate_up, down))
            middle = grouped_mm(xs, w1, counts, backend)[:, :inter]  # the down projection's input width
            grouped_mm(middle.contiguous(), w2, counts, backend).backward(grad_out)

        return call

    def one_gemm() -> None:
        xs, w1, w2 = (t.detach().requires_grad_() for t in (x, gate_up[0].T, down[0].T))
        middle = (xs @ w1)[:, :inter]
        (middle.contiguous() @ w2).backward(grad_out)

    backends = ["grouped_mm", "padded"] if select_gemm_backend(x, gate_up) == "grouped_mm" else ["padded"]
    return {**{backend: grouped(backend) for backend in backends}, "one GEMM": one_gemm}


def best_seconds(calls_of: dict[str, Callable[[], None]], calls: int, device: torch.device) -> dict[str, float]:
    best = dict.fromkeys(calls_of, float("inf"))
    for _ in range(calls + 1):  # the first round warms up every way
        for name, call in calls_of.items():
            began = time.perf_counter()
            call()
            if device.type == "cuda":
                torch.cuda.synchronize()
            best[name] = min(best[name], time.perf_counter() - began)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["few-large", "many-small"], choices=list(SHAPES))
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    dtype = getattr(torch, args.dtype)
    peak = matmul_peak_flops(dtype=dtype)
    print(f"{args.dtype} matmul peak: {peak / 1e9:.0f} GFLOP/s on {device} ({torch.get_num_threads()} threads)")
    for name in args.shapes:
        shape = SHAPES[name]
        x, counts = expert_rows(shape, device, dtype)
        useful = 6 * x.shape[0] * 3 * shape.hidden * shape.moe_intermediate
        print(
            f"{name}: {x.shape[0]} rows on {shape.experts} experts (largest {int(counts.max())}, mean "
            f"{x.shape[0] / shape.experts:.0f}), hidden {shape.hidden}, intermediate {shape.moe_intermediate}"
        )
        for way, seconds in best_seconds(ways(shape, x, counts), args.calls, device).items():
            flops = useful / seconds
            print(f"  {way:<11} {seconds * 1e3:7.2f} ms  {flops / 1e9:6.0f} GFLOP/s  {flops / peak:4.0%} of peak")


if __name__ == "__main__":
    main()
