"""Compiled blocks when the row length changes from batch to batch (RL rollouts: each batch padded to its longest row).

One process (on a CUDA GPU where there is one), the blocks compiled as a rank compiles them (``compile_blocks``), fused
AdamW, fp32. Each run trains one step per width of ``--widths`` (every width new), then ``--steady`` more at the last
width, in three modes:

    eager        no compiling
    per-shape    dynamo's automatic dynamic shapes off: every new width compiles a graph of its own (static shapes),
                 up to the recompile limit (raymoe until this benchmark's commit)
    automatic    torch.compile's default (``dynamic=None``): the first width compiles a static graph, the first change
                 one graph with the length symbolic, which serves every later width (raymoe now)

Each run is a process of its own with an empty inductor cache (a cached graph would compile in no time). Prints, per
mode, the seconds spent compiling over the widths, the wall time of those steps, and the median step time at the last
width afterwards (the graph a long run keeps using), best of ``--rounds`` alternating rounds::

    .venv/bin/python benchmarks/bench_dynamic_shapes.py --shape few-large --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

MODES = ("eager", "per-shape", "automatic")


def run_mode(directory: str, mode: str, batch: int, vocab: int, widths: list[int], steady: int) -> dict[str, float]:
    """This process: one step per width, then ``steady`` at the last one; compile seconds, wall, steady median."""
    import torch
    from _raymoe_one_process import model_and_optimizer, timed_step

    from raymoe.parallel.compiled_blocks import compile_seconds

    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    model, optimizer = model_and_optimizer(directory, mode != "eager", device)
    torch._dynamo.config.automatic_dynamic_shapes = mode != "per-shape"
    gen = torch.Generator().manual_seed(1)

    def step(width: int) -> float:
        return timed_step(model, optimizer, torch.randint(0, vocab, (batch, width), generator=gen).to(device))

    widths_s = sum(step(width) for width in widths)
    steady_s = statistics.median(step(widths[-1]) for _ in range(steady))
    compiled_s = compile_seconds() if mode != "eager" else 0.0
    return {"compile_s": compiled_s, "widths_s": widths_s, "steady_step_s": steady_s}


def main() -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from _model_shape import SHAPES, save_checkpoint

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="few-large", choices=sorted(SHAPES))
    parser.add_argument("--widths", type=int, nargs="+", default=[192, 208, 224, 240, 256, 232, 200, 248])
    parser.add_argument("--steady", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", type=Path, help="write the rows here too")
    parser.add_argument("--run-mode", help=argparse.SUPPRESS)  # internal: one mode in this process
    parser.add_argument("--checkpoint", help=argparse.SUPPRESS)
    args = parser.parse_args()
    shape = SHAPES[args.shape]
    if args.run_mode:
        result = run_mode(args.checkpoint, args.run_mode, shape.batch, shape.vocab, args.widths, args.steady)
        print("RESULT " + json.dumps(result), flush=True)
        return
    best: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        save_checkpoint(Path(scratch) / "model", shape)
        for _ in range(args.rounds):
            for mode in MODES:
                env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": tempfile.mkdtemp(dir=scratch)}
                command = [sys.executable, __file__, "--shape", args.shape, "--steady", str(args.steady)]
                command += ["--widths", *map(str, args.widths), "--run-mode", mode]
                command += ["--checkpoint", str(Path(scratch) / "model")]
                out = subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout
                result = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])
                kept = best.get(mode)
                best[mode] = result if kept is None or result["widths_s"] < kept["widths_s"] else kept
                best[mode]["steady_step_s"] = min(best[mode]["steady_step_s"], result["steady_step_s"])
    print(f"{args.shape}: {shape.describe()}; widths {args.widths}, then {args.steady} steps at {args.widths[-1]}")
    print("| mode | compiling over the widths | the widths' steps | steady step (last width) | vs eager |")
    print("|---|---|---|---|---|")
    for mode in MODES:
        row = best[mode]
        ratio = best["eager"]["steady_step_s"] / row["steady_step_s"]
        print(
            f"| {mode} | {row['compile_s']:.1f} s | {row['widths_s']:.1f} s | {row['steady_step_s'] * 1e3:.0f} ms "
            f"| {ratio:.2f}x |"
        )
    if args.json:
        args.json.write_text(json.dumps({"shape": args.shape, "widths": args.widths, "rows": best}, indent=1))


if __name__ == "__main__":
    main()
