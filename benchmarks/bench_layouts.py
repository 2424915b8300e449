"""Training throughput and peak memory per rank over a matrix of shapes, world sizes and layouts (issue 18).

Every row of one shape trains the same CPU-sized Qwen3-MoE checkpoint (``_model_shape.SHAPES``) on the same
global batches with AdamW: torch's fused kernel, which raymoe's ranks use and transformers' Trainer defaults
to with torch >= 2.8, except in transformers' tensor-parallel rows without FSDP, whose one parameter group
mixes DTensors with plain tensors (the norms), which the fused step refuses: there torch's default step runs
(``_torchrun_transformers.py``). Columns, all measured in this one invocation so their ratios share the
machine's state:

    one process               transformers (grouped_mm experts), raymoe.load_model: no process group
    transformers + torchrun   transformers' DistributedConfig, one process per rank (gloo on CPU, NCCL on GPU)
    raymoe on Ray             raymoe.from_pretrained, one Ray actor per rank, driver round trip every step
    ... reshard always        (--reshard-always) raymoe with DistributedConfig(fsdp_reshard_after_forward="always"):
                              every FSDP2 unit gathers again in backward, the default before "auto"
    ... compiled              the same with compiled decoder blocks (raymoe: compile=True, each block's forward;
                              transformers, with --transformers-compile: model.compile(), its users' way); the
                              compilation happens in the warm-up steps and its seconds are the "compile s" column;
                              with both compiled, "vs transformers compiled" is raymoe's over transformers' rate
    1/N of the batch          raymoe.load_model in one process with one thread on 1/N of the batch: what each
                              rank of a world of N computes, without communication. Its global tokens/s is
                              the ceiling of that world where every rank has a core of its own (a rank gets
                              one thread); a world larger than the machine's cores shares them.

tokens/s is global tokens per second of wall time per optimizer step (median over the timed steps, after
``--warmup``); each one-process and distributed row is the best of ``--rounds`` rounds, the systems of
its shape (one process) or layout alternating. Peak memory is per rank during the timed steps (RSS on CPU,
``torch.cuda.max_memory_allocated`` on GPU; ``_peak_memory.py``), and so is its growth over the memory in use
when they began (activations, gradients and temporaries of a step: weights and optimizer state are already
there); the table shows the largest rank's. One-process rows get every CPU as torch threads, distributed rows
one thread per rank. The activation-checkpointing rows train raymoe's fsdp layout at world 2 under ``none |
full | selective`` on a longer batch (``--ac-batch`` x ``--ac-seq``), where activations outweigh the process's
baseline; their ratio is to ``ac=none``.

"of peak" is a row's achieved model FLOP/s over the machine's fp32 matmul peak, measured at the start of the run (the
best of a few 2048^3 GEMMs on every CPU thread, or on the GPU): counted FLOPs are 6 per active matmul weight per token
(forward 2, backward 4: attention projections, the router, the top-k experts' or the dense MLP's three projections,
the head) plus causal attention's 6 x 2 x S x H per layer (its score and value products, half of them masked).
Results go to ``--out`` as JSON and markdown.

    python3.11 -m venv .venv-bench && .venv-bench/bin/pip install -c constraints.txt -e '.[bench]'
    .venv-bench/bin/python benchmarks/bench_layouts.py [--shapes few-large] [--worlds 2] [--layouts fsdp2 tp2-ep2]

The bench extra is transformers and accelerate (its distributed path needs it), not the test extra: that one
installs ``datasets`` and with it pyarrow, which every Ray worker imports when pyarrow is importable (Ray
registers serializers for it), about 24 MiB more RSS per rank that a plain raymoe install does not have.

Not run by the test suite.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import _peak_memory
import torch
from _model_shape import MATRIX_SHAPES, SHAPES, Shape, save_checkpoint

from raymoe import DistributedConfig

# name -> DistributedConfig sizes; the world size is their product
LAYOUTS: dict[str, dict[str, int]] = {
    "fsdp2": {"fsdp_size": 2},
    "fsdp2-ep2": {"fsdp_size": 2, "ep_size": 2},
    "tp2-ep2": {"tp_size": 2, "ep_size": 2},
    "hsdp2x1": {"dp_replicate_size": 2, "fsdp_size": 1},
    "fsdp4": {"fsdp_size": 4},
    "fsdp4-ep4": {"fsdp_size": 4, "ep_size": 4},
    "tp2-fsdp2-ep2": {"tp_size": 2, "fsdp_size": 2, "ep_size": 2},
    "hsdp2x2-ep2": {"dp_replicate_size": 2, "fsdp_size": 2, "ep_size": 2},
}
AC_LAYOUT = "fsdp2"
ONE_PROCESS_THREADS = os.cpu_count() or 1
AC_MODES = ("none", "full", "selective")
HERE = Path(__file__).parent
TRANSFORMERS_SCRIPT = HERE / "_torchrun_transformers.py"
RAYMOE_ONE_PROCESS_SCRIPT = HERE / "_raymoe_one_process.py"


def world_of(layout: dict[str, Any]) -> int:
    """The layout's world size, as raymoe's ``DistributedConfig`` computes it (CFG-1)."""
    return DistributedConfig(**layout).world_size


@dataclass
class Row:
    """One measured system on one (shape, layout): best tokens/s over the rounds and its peak memory per rank."""

    shape: str
    layout: str
    world: int
    system: str
    tokens_per_s: float = 0.0
    peak_mib: list[float] = field(default_factory=list)
    start_mib: list[float] = field(default_factory=list)  # in use when the timed steps began
    rounds: list[float] = field(default_factory=list)
    error: str | None = None
    compile_s: float | None = None  # seconds the first (warm-up) step spent compiling, the largest rank's

    def keep(self, speed: float, memory: list[list[float]], compile_s: float | None = None) -> None:
        """A round's tokens/s and ``[peak, start]`` MiB per rank; the best round's are kept (the compile seconds:
        the first round's, which compiled from nothing)."""
        self.rounds.append(speed)
        if compile_s is not None and self.compile_s is None:
            self.compile_s = compile_s
        if speed > self.tokens_per_s:
            self.tokens_per_s = speed
            self.peak_mib, self.start_mib = [m[0] for m in memory], [m[1] for m in memory]

    @property
    def growth_mib(self) -> float:
        return max(peak - start for peak, start in zip(self.peak_mib, self.start_mib, strict=True))


def tokens_per_s(step_seconds: list[float], shape: Shape, warmup: int) -> float:
    return shape.batch * (shape.seq - 1) / statistics.median(step_seconds[warmup:])


# step seconds, [peak, start] MiB per rank, compile seconds (compiled rows)
Measured = tuple[list[float], list[list[float]], float | None]


def flops_per_token(shape: Shape) -> float:
    """Training FLOPs of one token (forward and backward), as the module docstring counts them."""
    head_dim = shape.hidden // shape.heads
    attention = shape.hidden * head_dim * (2 * shape.heads + 2 * shape.kv_heads)
    sparse = shape.hidden * shape.experts + shape.top_k * 3 * shape.hidden * shape.moe_intermediate
    dense = 3 * shape.hidden * shape.dense_width
    weights = sum(attention + (dense if i in shape.dense_layers else sparse) for i in range(shape.layers))
    scores = shape.layers * 2 * shape.seq * shape.hidden  # QK^T and AV over the causal half, per token
    return 6 * (weights + shape.vocab * shape.hidden) + 6 * scores


def matmul_peak_flops(size: int = 2048, repeats: int = 10, dtype: torch.dtype = torch.float32) -> float:
    """The machine's GEMM FLOP/s in ``dtype``: the best of ``repeats`` ``size^3`` products (every CPU thread, or the
    GPU)."""
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    a, b = (torch.randn(size, size, device=device, dtype=dtype) for _ in range(2))
    best = float("inf")
    for _ in range(repeats + 1):
        began = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - began)
    return 2 * size**3 / best


def run_script(command: list[str], what: str, threads: int = 1) -> Measured:
    """Step seconds and memory per rank printed by a row's script (``STEP_SECONDS`` / ``PEAK_MIB`` lines)."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(threads),
        "PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parent)]),
    }
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800, check=False)
    found = {
        key: json.loads(line.removeprefix(key + " "))
        for line in done.stdout.splitlines()
        for key in ("STEP_SECONDS", "PEAK_MIB", "COMPILE_S")
        if line.startswith(key + " ")
    }
    if done.returncode != 0 or "STEP_SECONDS" not in found or "PEAK_MIB" not in found:
        raise RuntimeError(f"{what} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    return found["STEP_SECONDS"], found["PEAK_MIB"], found.get("COMPILE_S")


def shape_argv(shape: Shape, args: argparse.Namespace) -> list[str]:
    return [str(shape.batch), str(shape.seq), str(shape.vocab), str(args.warmup + args.steps), str(args.warmup)]


def transformers_run(
    directory: Path, layout: dict[str, int], shape: Shape, args: argparse.Namespace, compiled: bool = False
) -> Measured:
    world = world_of(layout)
    launcher = (
        [sys.executable]
        if world == 1
        else [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world)]
    )
    command = [*launcher, str(TRANSFORMERS_SCRIPT), str(directory), json.dumps(layout), *shape_argv(shape, args)]
    command += ["compile"] if compiled else []
    return run_script(
        command, f"transformers {layout or 'one process'}", threads=ONE_PROCESS_THREADS if world == 1 else 1
    )


def raymoe_one_process(
    directory: Path, shape: Shape, args: argparse.Namespace, threads: int = ONE_PROCESS_THREADS, compiled: bool = False
) -> Measured:
    command = [sys.executable, str(RAYMOE_ONE_PROCESS_SCRIPT), str(directory), *shape_argv(shape, args)]
    command += ["compile"] if compiled else []
    return run_script(command, f"raymoe one process (batch {shape.batch}, {threads} threads)", threads=threads)


def rank_share(directory: Path, shape: Shape, world: int, args: argparse.Namespace) -> Measured:
    """One process, one thread, ``1/world`` of the batch: what each rank of a world computes, with no communication."""
    return raymoe_one_process(directory, replace(shape, batch=shape.batch // world), args, threads=1)


def raymoe_on_ray(
    directory: Path, layout: dict[str, Any], shape: Shape, args: argparse.Namespace, compiled: bool = False
) -> Measured:
    import raymoe

    gen = torch.Generator().manual_seed(1)
    data = [
        torch.randint(0, shape.vocab, (shape.batch, shape.seq), generator=gen) for _ in range(args.warmup + args.steps)
    ]
    times, compiling = [], 0.0
    with raymoe.from_pretrained(directory, distributed_config=layout, compile=compiled) as model:
        model.configure_training(lr=1e-4, betas=(0.9, 0.999), max_grad_norm=None)  # the other rows: torch defaults
        for step, ids in enumerate(data):
            if step == args.warmup:
                starts = model.run_on_ranks(lambda ctx: _peak_memory.reset(ctx.device))
            began = time.perf_counter()
            compiling += model.train_step(ids).get("compile_s", 0.0)
            times.append(time.perf_counter() - began)
        peaks = model.run_on_ranks(lambda ctx: _peak_memory.peak_mib(ctx.device))
    return times, [[peak, start] for peak, start in zip(peaks, starts, strict=True)], compiling if compiled else None


def measure(
    rows: dict[tuple[str, str, str], Row],
    key: tuple[str, str, str],
    world: int,
    run: Any,
    shape: Shape,
    args: argparse.Namespace,
) -> None:
    row = rows.setdefault(key, Row(key[0], key[1], world, key[2]))
    try:
        times, peaks, compile_s = run()
        row.keep(tokens_per_s(times, shape, args.warmup), peaks, compile_s)
    except Exception as exc:  # a system that cannot run a layout is a row with its error, not the end of the matrix
        row.error = f"{type(exc).__name__}: {cause(str(exc))}"
        print(f"  {key}: {row.error}", flush=True)


def measure_alternating(
    rows: dict[tuple[str, str, str], Row],
    shape_name: str,
    row_name: str,
    world: int,
    systems: dict[str, Any],
    shape: Shape,
    args: argparse.Namespace,
) -> None:
    """Each of ``systems`` (name -> run) on the row ``row_name``, ``--rounds`` rounds with the systems alternating;
    each system's row keeps its best round."""
    for _ in range(args.rounds):
        for system, run in systems.items():
            measure(rows, (shape_name, row_name, system), world, run, shape, args)


def cause(message: str) -> str:
    """The line of a failed run's output that names the error (the last with "Error" that is not torchrun's
    summary of a failed child), else its last line."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()] or [""]
    named = [line for line in lines if "Error" in line and "ChildFailedError" not in line]
    return (named or lines)[-1][:300]


def run_matrix(args: argparse.Namespace) -> list[Row]:
    import ray

    # before Ray starts: its processes' start-up would take the cores from the GEMMs
    args.matmul_peak_flops = matmul_peak_flops()
    print(f"fp32 matmul peak: {args.matmul_peak_flops / 1e9:.0f} GFLOP/s", flush=True)
    ray.init(address="local", num_cpus=max(args.worlds), include_dashboard=False, log_to_driver=False)
    ray.cloudpickle.register_pickle_by_value(_peak_memory)
    rows: dict[tuple[str, str, str], Row] = {}
    for shape_name in args.shapes:
        shape = SHAPES[shape_name]
        print(f"shape {shape_name}: {shape.describe()}", flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            directory = Path(tmp)
            save_checkpoint(directory, shape)
            one_process = {
                "transformers": partial(transformers_run, directory, {}, shape, args),
                "raymoe": partial(raymoe_one_process, directory, shape, args),
            }
            if args.transformers_compile:
                one_process["transformers compiled"] = partial(transformers_run, directory, {}, shape, args, True)
            if args.compile:
                one_process["raymoe compiled"] = partial(raymoe_one_process, directory, shape, args, compiled=True)
            # alternating, as a layout's systems: one run moves a ratio by 0.1 here
            measure_alternating(rows, shape_name, "one process", 1, one_process, shape, args)
            for world in args.worlds:  # the ceiling of a world: its ranks' compute alone, as global tokens/s
                share = partial(rank_share, directory, shape, world, args)
                measure(rows, (shape_name, share_row(world), "raymoe"), world, share, shape, args)
            for name in args.layouts:
                if world_of(LAYOUTS[name]) in args.worlds:
                    measure_layout(rows, directory, shape_name, name, args)
            if shape_name in args.ac_shapes and 2 in args.worlds:
                measure_checkpointing(rows, directory, shape_name, args)
            write(list(rows.values()), args)
    return list(rows.values())


def measure_layout(
    rows: dict[tuple[str, str, str], Row], directory: Path, shape_name: str, name: str, args: argparse.Namespace
) -> None:
    """Both distributed systems on one layout, alternating for ``--rounds`` rounds (each keeps its best round)."""
    shape, layout = SHAPES[shape_name], LAYOUTS[name]
    systems = {
        "transformers+torchrun": partial(transformers_run, directory, layout, shape, args),
        "raymoe on Ray": partial(raymoe_on_ray, directory, layout, shape, args),
    }
    if args.transformers_compile:
        systems["transformers+torchrun compiled"] = partial(transformers_run, directory, layout, shape, args, True)
    if args.compile:
        systems["raymoe compiled on Ray"] = partial(raymoe_on_ray, directory, layout, shape, args, True)
    if args.reshard_always:
        always = {**layout, "fsdp_reshard_after_forward": "always"}
        systems[RESHARD_ALWAYS] = partial(raymoe_on_ray, directory, always, shape, args)
    measure_alternating(rows, shape_name, name, world_of(layout), systems, shape, args)
    measured = ", ".join(f"{r.system} {r.tokens_per_s:.0f}" for k, r in rows.items() if k[:2] == (shape_name, name))
    print(f"  {name}: {measured}", flush=True)


def measure_checkpointing(
    rows: dict[tuple[str, str, str], Row], directory: Path, shape_name: str, args: argparse.Namespace
) -> None:
    """raymoe's ``AC_LAYOUT`` under each activation-checkpointing mode, on the longer ``--ac-batch x --ac-seq``."""
    long_batch = replace(SHAPES[shape_name], batch=args.ac_batch, seq=args.ac_seq)
    for mode in AC_MODES:
        layout = {**LAYOUTS[AC_LAYOUT], "activation_checkpointing": mode}
        run = partial(raymoe_on_ray, directory, layout, long_batch, args)
        for _ in range(args.rounds):
            measure(rows, (shape_name, ac_row(mode, long_batch), "raymoe on Ray"), 2, run, long_batch, args)


def share_row(world: int) -> str:
    return f"1/{world} of the batch, 1 thread"


def ac_row(mode: str, shape: Shape) -> str:
    return f"{AC_LAYOUT} ac={mode} ({shape.batch}x{shape.seq})"


RESHARD_ALWAYS = "raymoe on Ray, reshard always"
# the column "vs raymoe eager": compiled over eager; the default (reshard auto) over "always" (the choice before it)
EAGER_OF = {"raymoe compiled": "raymoe", "raymoe compiled on Ray": "raymoe on Ray", "raymoe on Ray": RESHARD_ALWAYS}
TRANSFORMERS_OF = {"one process": "transformers"}  # else "transformers+torchrun"


def markdown(rows: list[Row], args: argparse.Namespace) -> str:
    speed = {(r.shape, r.layout, r.system): r.tokens_per_s for r in rows}
    peak = getattr(args, "matmul_peak_flops", None)
    lines = [
        f"steps {args.steps} after {args.warmup} warm-up, best of {args.rounds} rounds; torch {torch.__version__}, "
        f"{os.cpu_count()} CPUs{', ' + torch.cuda.get_device_name() if torch.cuda.is_available() else ''}; "
        f"one process: {ONE_PROCESS_THREADS} threads, distributed: 1 thread per rank"
        + (f"; fp32 matmul peak {peak / 1e9:.0f} GFLOP/s" if peak else ""),
        "",
        "| shape | world | layout | system | tokens/s | vs transformers | vs transformers compiled | vs raymoe eager "
        "| vs one process (raymoe) | of peak | compile s | peak MiB per rank | step growth MiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.error and not r.tokens_per_s:
            lines.append(f"| {r.shape} | {r.world} | {r.layout} | {r.system} | failed: {r.error} | | | | | | | | |")
            continue
        transformers = TRANSFORMERS_OF.get(r.layout, "transformers+torchrun")
        baseline = speed.get((r.shape, r.layout, transformers))
        compiled_baseline = speed.get((r.shape, r.layout, transformers + " compiled"))
        eager = speed.get((r.shape, r.layout, EAGER_OF.get(r.system, "")))
        if " ac=" in r.layout:  # its own batch: compared with no checkpointing on that batch
            reference = speed.get(
                (r.shape, ac_row("none", replace(SHAPES[r.shape], batch=args.ac_batch, seq=args.ac_seq)), r.system)
            )
        else:
            reference = speed.get((r.shape, "one process", "raymoe")) if r.layout != "one process" else None
        vs_baseline = f"{r.tokens_per_s / baseline:.2f}x" if baseline and r.system.startswith("raymoe") else ""
        if baseline and r.system.startswith("transformers") and r.system.endswith("compiled"):
            vs_baseline = f"{r.tokens_per_s / baseline:.2f}x"  # transformers compiled over its eager self
        both_compiled = compiled_baseline and r.system.startswith("raymoe compiled")
        vs_compiled = f"{r.tokens_per_s / compiled_baseline:.2f}x" if both_compiled else ""
        vs_eager = f"{r.tokens_per_s / eager:.2f}x" if eager else ""
        vs_reference = f"{r.tokens_per_s / reference:.2f}x" if reference else ""
        shape = SHAPES[r.shape] if " ac=" not in r.layout else replace(SHAPES[r.shape], seq=args.ac_seq)
        # not for the 1/N rows: their tokens/s is a ceiling (N single-threaded shares), not a measured rate
        measured = peak and not r.layout.startswith("1/")
        of_peak = f"{r.tokens_per_s * flops_per_token(shape) / peak:.0%}" if measured else ""
        compile_s = f"{r.compile_s:.0f}" if r.compile_s is not None else ""
        lines.append(
            f"| {r.shape} | {r.world} | {r.layout} | {r.system} | {r.tokens_per_s:.0f} | {vs_baseline} | {vs_compiled} "
            f"| {vs_eager} "
            f"| {vs_reference} | {of_peak} | {compile_s} | {max(r.peak_mib):.0f} | {r.growth_mib:.0f} |"
        )
    lines += [
        "",
        "vs transformers: over transformers (one process) or transformers+torchrun on the same row, both eager; for "
        "transformers' compiled row, over its eager self. vs transformers compiled: raymoe compiled over transformers "
        "after model.compile() on the same row (--transformers-compile). "
        "peak: the largest rank's peak during the timed steps (RSS on CPU: the process's baseline included); "
        "step growth: the largest rank's peak minus its memory in use when the timed steps began. "
        "ac rows: ratio to ac=none on the same batch.",
        *[
            f"{r.shape} {r.layout} {r.system}: a round failed ({r.error}); the row is its other rounds' best."
            for r in rows
            if r.error and r.tokens_per_s
        ],
    ]
    return "\n".join(lines) + "\n"


def write(rows: list[Row], args: argparse.Namespace) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shapes = {name: asdict(SHAPES[name]) for name in args.shapes}
    (out / "bench_layouts.json").write_text(
        json.dumps(
            {"args": vars(args), "shapes": shapes, "torch": torch.__version__, "rows": [asdict(r) for r in rows]},
            indent=1,
        )
    )
    (out / "bench_layouts.md").write_text(markdown(rows, args))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=list(MATRIX_SHAPES), choices=list(SHAPES))
    parser.add_argument("--worlds", nargs="+", type=int, default=[2, 4], choices=[2, 4])
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument(
        "--ac-shapes",
        nargs="*",
        default=["dense-heavy"],
        choices=list(SHAPES),
        help="shapes with activation-checkpointing rows",
    )
    parser.add_argument("--ac-batch", type=int, default=8)
    parser.add_argument("--ac-seq", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="rows of raymoe with compiled decoder blocks (default: on)",
    )
    parser.add_argument(
        "--transformers-compile", action="store_true", help="rows of transformers after model.compile() too"
    )
    parser.add_argument(
        "--reshard-always",
        action="store_true",
        help="rows of raymoe with fsdp_reshard_after_forward='always' too (every unit gathers again in backward: the "
        "behaviour before 'auto'); the default row's 'vs raymoe eager' is then its ratio to them",
    )
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    torch.set_num_threads(2)
    rows = run_matrix(args)
    print(markdown(rows, args))


if __name__ == "__main__":
    main()
