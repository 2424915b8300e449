"""Where a raymoe training step spends its time, per rank: torch's profiler around a few steps of one layout.

    .venv/bin/python benchmarks/profile_layouts.py --layout fsdp2-ep2 [--steps 3] [--out /tmp/prof]
    .venv/bin/python benchmarks/profile_layouts.py --layout tp2-ep2 --compile   # compiled decoder blocks
    .venv/bin/python benchmarks/profile_layouts.py --layout one-process [--compile]   # no Ray: load_model here

Each rank profiles its own process (CPU activities, and CUDA on a GPU) between two calls the driver makes
through ``run_on_ranks``; the driver times the same steps. Printed: the driver's step time, and for rank 0
the operators by self time, then by total time (collectives show as ``gloo:`` / ``nccl:`` records and
``c10d::`` ops). ``--out`` keeps every rank's Chrome trace (``rank<r>.json``; ``one_process.json`` for
one-process; open in chrome://tracing or https://ui.perfetto.dev). The model and batch are bench_layouts.py's
(``--shape``). Not run by the test suite.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from _model_shape import SHAPES, save_checkpoint, shape_args
from bench_layouts import LAYOUTS, world_of


def start_profile(ctx: Any) -> int:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if ctx.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    profiler = torch.profiler.profile(activities=activities, record_shapes=False)
    profiler.start()
    ctx.bench_profiler = profiler  # on the rank's context: this function travels by value, its globals with it
    return torch.get_num_threads()


def stop_profile(ctx: Any, out: str | None, rows: int) -> tuple[str, str]:
    profiler = ctx.bench_profiler
    profiler.stop()
    if out:
        profiler.export_chrome_trace(str(Path(out) / f"rank{ctx.rank}.json"))
    averages = profiler.key_averages()
    sort = "self_cuda_time_total" if ctx.device.type == "cuda" else "self_cpu_time_total"
    total = "cuda_time_total" if ctx.device.type == "cuda" else "cpu_time_total"
    return averages.table(sort_by=sort, row_limit=rows), averages.table(sort_by=total, row_limit=rows)


def profile_raymoe(directory: Path, layout: dict[str, Any], data: list[torch.Tensor], args: argparse.Namespace) -> None:
    import ray

    import raymoe

    if not ray.is_initialized():
        ray.init(address="local", num_cpus=max(2, world_of(layout)), include_dashboard=False, log_to_driver=False)
    # --compile: compiled on any device; without it, the default (compiled on CUDA, eager on CPU)
    with raymoe.from_pretrained(directory, distributed_config=layout, compile=True if args.compile else None) as model:
        model.configure_training(lr=1e-4, max_grad_norm=None)
        for ids in data[: args.warmup]:
            model.train_step(ids)
        threads = model.run_on_ranks(start_profile)
        began = time.perf_counter()
        for ids in data[args.warmup :]:
            model.train_step(ids)
        seconds = (time.perf_counter() - began) / args.steps
        tables = model.run_on_ranks(stop_profile, args.out, args.rows)
    print(f"{args.layout}: {seconds:.3f} s per step on the driver; torch threads per rank {threads}")
    print("rank 0, by self time:\n" + tables[0][0])
    print("rank 0, by total time:\n" + tables[0][1])


def profile_one_process(directory: Path, data: list[torch.Tensor], args: argparse.Namespace) -> None:
    from _raymoe_one_process import model_and_optimizer

    from raymoe.models import causal_lm_loss

    model, optimizer = model_and_optimizer(str(directory), args.compile, torch.device("cpu"))  # bench_layouts' row

    def step(ids: torch.Tensor) -> None:
        causal_lm_loss(model(ids), ids).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for ids in data[: args.warmup]:
        step(ids)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        began = time.perf_counter()
        for ids in data[args.warmup :]:
            step(ids)
        seconds = (time.perf_counter() - began) / args.steps
    compiled = ", compiled blocks" if args.compile else ""
    print(f"one process{compiled}: {seconds:.3f} s per step; torch threads {torch.get_num_threads()}")
    print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))
    if args.out:
        profiler.export_chrome_trace(str(Path(args.out) / "one_process.json"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layout", default="fsdp2", choices=["one-process", *LAYOUTS])
    parser.add_argument("--shape", default=next(iter(SHAPES)), choices=list(SHAPES))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--rows", type=int, default=25)
    parser.add_argument(
        "--out", default=None, help="folder for every rank's Chrome trace (one_process.json for one-process)"
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="compile the decoder blocks (the ranks', or one-process's model), on CPU too",
    )
    args = parser.parse_args()
    shape = shape_args(args.shape)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(1)
    data = [
        torch.randint(0, shape.vocab, (shape.batch, shape.seq), generator=gen) for _ in range(args.warmup + args.steps)
    ]
    with tempfile.TemporaryDirectory() as tmp:
        save_checkpoint(Path(tmp), shape)
        if args.layout == "one-process":
            profile_one_process(Path(tmp), data, args)
        else:
            profile_raymoe(Path(tmp), LAYOUTS[args.layout], data, args)


if __name__ == "__main__":
    main()
