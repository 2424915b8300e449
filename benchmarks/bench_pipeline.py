"""Pipeline parallelism against FSDP at the same world size, and the bubble each schedule leaves (issue 19).

Every row of one shape trains the same CPU-sized Qwen3-MoE checkpoint (``_model_shape.SHAPES``) on the same
global batches with ``raymoe.from_pretrained`` on Ray, one rank per actor:

    world 2   fsdp2 | pp2 1f1b | pp2 gpipe | pp2 interleaved_1f1b (2 stages per rank)
    world 4   fsdp4 | pp2 x fsdp2 1f1b

Columns: tokens/s (median step after ``--warmup``, best of ``--rounds`` alternating rounds), its ratio to the
FSDP row of the same world, and the bubble. The *measured* bubble is each rank's time blocked in the
pipeline's point-to-point waits (``torch.distributed.pipelining``'s ``_wait_batch_p2p``, wrapped on every rank)
divided by the time of its schedule steps, over the timed steps; the table gives the mean and the largest over
ranks. The *theoretical* bubble of ``p`` ranks, ``m`` micro-batches and ``v`` stages per rank is
``(p - 1) / (v * m + p - 1)``: the idle share of a schedule whose stages all take the same time and whose
messages cost nothing. Results go to ``--out`` as JSON and markdown.

    .venv/bin/python benchmarks/bench_pipeline.py [--shapes few-large] [--rounds 2] [--microbatches 4]

Not run by the test suite.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from _model_shape import MATRIX_SHAPES, SHAPES, Shape, save_checkpoint

from raymoe import DistributedConfig


def layouts(microbatches: int) -> dict[str, dict[str, Any]]:
    """name -> DistributedConfig fields; ``microbatches`` pieces per rank's rows (fewer where a rank holds fewer)."""
    return {
        "fsdp2": {"fsdp_size": 2},
        "pp2-1f1b": {"pp_size": 2, "pp_microbatches": microbatches},
        "pp2-gpipe": {"pp_size": 2, "pp_schedule": "gpipe", "pp_microbatches": microbatches},
        "pp2-interleaved": {"pp_size": 2, "pp_schedule": "interleaved_1f1b", "pp_microbatches": microbatches},
        "fsdp4": {"fsdp_size": 4},
        "pp2-fsdp2-1f1b": {"pp_size": 2, "fsdp_size": 2, "pp_microbatches": max(2, microbatches // 2)},
    }


@dataclass
class Row:
    shape: str
    layout: str
    world: int
    config: dict[str, Any]
    tokens_per_s: float = 0.0
    idle_mean: float | None = None
    idle_max: float | None = None
    error: str | None = None
    rounds: list[float] = field(default_factory=list)

    @property
    def theoretical(self) -> float | None:
        config = DistributedConfig(**self.config)
        p = config.pp_size or 1
        if p == 1:
            return None
        m, v = config.pp_microbatches or p, config.stages_per_rank
        return (p - 1) / (v * m + p - 1)


def _install_wait_clock(ctx: Any) -> None:
    """Wrap the pipeline's p2p wait and the schedule step on this rank with clocks kept on ``ctx``."""
    import torch.distributed.pipelining.schedules as schedules

    from raymoe.rank.pipeline import PipelineStages

    if getattr(ctx, "bench_clock", None) is not None:
        return
    clock = {"wait": 0.0, "step": 0.0}
    wait, step = schedules._wait_batch_p2p, PipelineStages._micro_batch

    def timed_wait(work: Any) -> Any:
        began = time.perf_counter()
        try:
            return wait(work)
        finally:
            clock["wait"] += time.perf_counter() - began

    def timed_step(*args: Any, **kwargs: Any) -> Any:
        began = time.perf_counter()
        try:
            return step(*args, **kwargs)
        finally:
            clock["step"] += time.perf_counter() - began

    schedules._wait_batch_p2p = timed_wait
    PipelineStages._micro_batch = timed_step
    ctx.bench_clock = clock


def _read_clock(ctx: Any) -> tuple[float, float]:
    clock = ctx.bench_clock
    values = (clock["wait"], clock["step"])
    clock["wait"] = clock["step"] = 0.0
    return values


def run_layout(directory: Path, config: dict[str, Any], shape: Shape, args: argparse.Namespace) -> tuple[float, list]:
    """(tokens/s, [(wait s, schedule s) per rank] over the timed steps) of one round."""
    import raymoe

    gen = torch.Generator().manual_seed(1)
    data = [
        torch.randint(0, shape.vocab, (shape.batch, shape.seq), generator=gen) for _ in range(args.warmup + args.steps)
    ]
    times = []
    pipelined = (config.get("pp_size") or 1) > 1
    with raymoe.from_pretrained(directory, distributed_config=config) as model:
        model.configure_training(lr=1e-4, max_grad_norm=1.0)
        if pipelined:
            model.run_on_ranks(_install_wait_clock)
        for step, ids in enumerate(data):
            if step == args.warmup and pipelined:
                model.run_on_ranks(_read_clock)
            began = time.perf_counter()
            model.train_step(ids)
            times.append(time.perf_counter() - began)
        clocks = model.run_on_ranks(_read_clock) if pipelined else []
    tokens = shape.batch * shape.seq
    return tokens / statistics.median(times[args.warmup :]), clocks


def measure(rows: list[Row], directory: Path, shape: Shape, args: argparse.Namespace) -> None:
    for round_index in range(args.rounds):
        order = rows if round_index % 2 == 0 else list(reversed(rows))
        for row in order:
            if row.error is not None:
                continue
            try:
                speed, clocks = run_layout(directory, row.config, shape, args)
            except Exception as exc:  # a layout that cannot run is a row with its error
                lines = str(exc).strip().splitlines()
                row.error = f"{type(exc).__name__}: {lines[-1][:300] if lines else ''}"
                print(f"  {row.shape} {row.layout}: {row.error}", flush=True)
                continue
            row.rounds.append(speed)
            if speed >= row.tokens_per_s:
                row.tokens_per_s = speed
                if clocks:
                    idle = [wait / step for wait, step in clocks if step > 0]
                    row.idle_mean, row.idle_max = statistics.mean(idle), max(idle)
            print(f"  {row.shape} {row.layout} round {round_index}: {speed:.0f} tokens/s", flush=True)


def markdown(rows: list[Row], args: argparse.Namespace) -> str:
    lines = [
        f"steps {args.steps} (+{args.warmup} warm-up), best of {args.rounds} rounds, batch {args.batch}x{args.seq}",
        "",
        "| shape | layout | world | tokens/s | vs fsdp (same world) | bubble measured (mean / max rank) "
        "| bubble theoretical |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    fsdp = {(r.shape, r.world): r.tokens_per_s for r in rows if "pp_size" not in r.config and r.error is None}
    for r in rows:
        if r.error is not None:
            lines.append(f"| {r.shape} | {r.layout} | {r.world} | error: {r.error} | | | |")
            continue
        base = fsdp.get((r.shape, r.world))
        ratio = f"{r.tokens_per_s / base:.2f}x" if base else ""
        measured = f"{r.idle_mean:.2f} / {r.idle_max:.2f}" if r.idle_mean is not None else ""
        theory = f"{r.theoretical:.2f}" if r.theoretical is not None else ""
        lines.append(f"| {r.shape} | {r.layout} | {r.world} | {r.tokens_per_s:.0f} | {ratio} | {measured} | {theory} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=list(MATRIX_SHAPES), choices=list(SHAPES))
    parser.add_argument("--layouts", nargs="+", default=None, help="names from the list above (default: all)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    torch.set_num_threads(2)
    chosen = layouts(args.microbatches)
    names = args.layouts or list(chosen)
    rows: list[Row] = []
    for shape_name in args.shapes:
        shape = Shape(**{**asdict(SHAPES[shape_name]), "batch": args.batch, "seq": args.seq})
        shape_rows = [
            Row(shape_name, name, DistributedConfig(**chosen[name]).world_size, chosen[name]) for name in names
        ]
        with tempfile.TemporaryDirectory() as tmp:
            directory = Path(tmp) / shape_name
            save_checkpoint(directory, shape)
            print(f"{shape_name}: {shape.describe()}", flush=True)
            measure(shape_rows, directory, shape, args)
        rows += shape_rows
    table = markdown(rows, args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_pipeline.md").write_text(table + "\n")
    payload = [{**asdict(r), "theoretical": r.theoretical} for r in rows]
    (out / "bench_pipeline.json").write_text(json.dumps(payload, indent=2) + "\n")
    print(table)


if __name__ == "__main__":
    main()
