"""gloo's reduce-scatter against raymoe's all-to-all one (raymoe.parallel.reduce_scatter), as FSDP2 calls it on CPU.

    .venv/bin/python benchmarks/bench_reduce_scatter.py [--worlds 2 4] [--mib 4 16] [--calls 6]

Each world is that many processes on this machine, one thread each, in one gloo group. For each buffer size (the
flat gradient of one FSDP2 unit, MiB of float32), the best of ``--calls`` calls of: ``reduce_scatter_tensor`` (FSDP2's
default), ``all_reduce`` of the same buffer (for scale), and ``AllToAllReduceScatter``. Calls alternate, after a
barrier each. Not run by the test suite.
"""

from __future__ import annotations

import argparse
import os
import socket
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from raymoe.parallel.reduce_scatter import AllToAllReduceScatter


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def ways(comm: AllToAllReduceScatter, buffer: torch.Tensor, output: torch.Tensor) -> dict[str, Callable[[], object]]:
    """The three calls timed on one buffer (the all-reduce sums in place: its values grow, its time does not)."""
    return {
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(output, buffer),
        "all_reduce": lambda: dist.all_reduce(buffer),
        "all-to-all + sum": lambda: comm(output, buffer, dist.group.WORLD, dist.ReduceOp.SUM),
    }


def rank_main(rank: int, world: int, port: int, mibs: list[int], calls: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    comm = AllToAllReduceScatter()
    for mib in mibs:
        numel = mib * (1 << 20) // 4 // world * world
        buffer, output = torch.randn(numel), torch.empty(numel // world)
        calls_of = ways(comm, buffer, output)
        best = dict.fromkeys(calls_of, float("inf"))
        for _ in range(calls):
            for name, call in calls_of.items():
                dist.barrier()
                began = time.perf_counter()
                call()
                best[name] = min(best[name], time.perf_counter() - began)
        if rank == 0:
            figures = ", ".join(f"{name} {seconds * 1e3:.1f} ms" for name, seconds in best.items())
            print(f"world {world}, {mib} MiB: {figures}", flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--mib", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--calls", type=int, default=6)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    for world in args.worlds:
        mp.spawn(rank_main, args=(world, free_port(), args.mib, args.calls), nprocs=world)


if __name__ == "__main__":
    main()
