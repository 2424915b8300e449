"""Does the plain-tensor fast path at the TP module boundaries pay off for inference? (SPEC STYLE-4)

Every TP style runs its module's forward on local shards; only the layout changes at the
boundary go through ``raymoe.parallel.styles.layouts.redistribute_local``. When no gradient can flow
it calls the collective directly instead of ``DTensor.from_local -> redistribute -> to_local``.
This times, under ``torch.no_grad`` on 2 CPU ranks (gloo, one thread each), two blocks with
their boundary changes done

    dtensor   always through DTensor (the path with autograd, used here as the baseline)
    shipped   redistribute_local as shipped (the fast path, since no gradient flows)

    mlp       colwise -> SiLU -> rowwise          one all-reduce (Partial -> Replicate)
    lm_head   colwise_gather_output               one all-gather (Shard(-1) -> Replicate)

and the bare all-reduce of the block's output, for scale. Timings on a busy 2-core machine are
noisy: compare the columns of one run. Run:

    .venv/bin/python benchmarks/tp_boundaries.py [--hidden 1024] [--inter 2816] [--tokens 1 16 256]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Placement

import raymoe.parallel.styles.layouts as layouts
import raymoe.parallel.styles.tensor as tensor_styles
from raymoe.parallel.apply import apply_rules


def dtensor_redistribute(
    x: Tensor, mesh: DeviceMesh, src: Placement, dst: Placement, *, grad: Placement | None = None
) -> Tensor:
    """The baseline: every layout change through DTensor, as with gradients."""
    if not isinstance(x, DTensor):
        if src == dst and grad is None:
            return x
        x = DTensor.from_local(x, mesh, [src], run_check=False)
    if x.placements != (dst,):
        x = x.redistribute(placements=[dst])
    return x.to_local(grad_placements=None if grad is None else [grad])


def time_per_call_us(fn: Callable[[], object], iters: int) -> float:
    for _ in range(20):
        fn()
    samples = []
    for _ in range(5):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        samples.append((time.perf_counter() - start) / iters * 1e6)
    return statistics.median(samples)


def build_blocks(hidden: int, inter: int, vocab: int, mesh: DeviceMesh) -> dict[str, nn.Module]:
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(hidden, inter), nn.SiLU(), nn.Linear(inter, hidden))
    apply_rules(mlp, {"0": "colwise", "2": "rowwise"}, mesh)
    lm_head = nn.Sequential(nn.Linear(hidden, vocab, bias=False))
    apply_rules(lm_head, {"0": "colwise_gather_output"}, mesh)
    return {"mlp": mlp, "lm_head": lm_head}


def run(rank: int, world_size: int, store: str, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    rows = []
    for name, block in build_blocks(args.hidden, args.inter, args.vocab, mesh).items():
        for tokens in args.tokens:
            x = torch.randn(tokens, args.hidden)
            with torch.no_grad():
                tensor_styles.redistribute_local = dtensor_redistribute
                dtensor_us = time_per_call_us(lambda block=block, x=x: block(x), args.iters)
                tensor_styles.redistribute_local = layouts.redistribute_local
                shipped_us = time_per_call_us(lambda block=block, x=x: block(x), args.iters)
                y = torch.randn(tokens, args.hidden)
                bare_us = time_per_call_us(lambda y=y: dist.all_reduce(y), args.iters)
            rows.append((name, tokens, dtensor_us, shipped_us, bare_us))
    if rank == 0:
        print(f"H={args.hidden}, I={args.inter}, V={args.vocab}, tp={world_size} (gloo, CPU, 1 thread/rank), no_grad")
        print(f"{'block':>8} {'tokens':>7} {'dtensor us':>11} {'shipped us':>11} {'saved':>7} {'all_reduce us':>14}")
        for name, tokens, dtensor_us, shipped_us, bare_us in rows:
            saved = (dtensor_us - shipped_us) / dtensor_us
            print(f"{name:>8} {tokens:>7} {dtensor_us:>11.0f} {shipped_us:>11.0f} {saved:>7.1%} {bare_us:>14.0f}")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--inter", type=int, default=2816)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 256])
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(run, args=(args.world_size, os.path.join(tmp, "store"), args), nprocs=args.world_size)


if __name__ == "__main__":
    main()
