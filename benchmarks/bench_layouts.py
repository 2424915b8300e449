"""Global training throughput at world size 2: raymoe on Ray against transformers + torchrun (issue 6).

Every row trains the same CPU-sized Qwen3-MoE checkpoint on the same global batch; tokens/s is
global tokens per second of wall time per optimizer step (median over the timed steps, after
warm-up; each distributed row is the best of ``--rounds`` rounds, the two systems alternating).
All rows run in this one invocation, so their ratios share the machine's state:

    one process     transformers (grouped_mm experts)   raymoe single-process model
    world size 2    transformers + torchrun (gloo, 1 thread per rank)
                    raymoe.from_pretrained on a local Ray (gloo, 1 CPU per rank)

    .venv/bin/pip install -c constraints.txt -e '.[test,bench]'   # transformers' distributed path needs accelerate
    .venv/bin/python benchmarks/bench_layouts.py [--steps 6] [--layouts fsdp2 fsdp2-ep2 tp2-ep2]

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
from collections.abc import Callable
from pathlib import Path

import torch
import transformers
from _model_shape import add_shape_args, save_checkpoint

LAYOUTS = {
    "fsdp2": {"fsdp_size": 2},
    "fsdp2-ep2": {"fsdp_size": 2, "ep_size": 2},
    "tp2-ep2": {"tp_size": 2, "ep_size": 2},
}
TORCHRUN_SCRIPT = Path(__file__).with_name("_torchrun_transformers.py")


def batches(args: argparse.Namespace) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [
        torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen) for _ in range(args.warmup + args.steps)
    ]


def tokens_per_s(step_seconds: list[float], args: argparse.Namespace) -> float:
    return args.batch * (args.seq - 1) / statistics.median(step_seconds[args.warmup :])


def time_steps(step: Callable[[torch.Tensor], object], data: list[torch.Tensor]) -> list[float]:
    times = []
    for ids in data:
        began = time.perf_counter()
        step(ids)
        times.append(time.perf_counter() - began)
    return times


def one_process_transformers(directory: Path, data: list[torch.Tensor]) -> list[float]:
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, experts_implementation="grouped_mm").train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(ids: torch.Tensor) -> None:
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return time_steps(step, data)


def one_process_raymoe(directory: Path, data: list[torch.Tensor]) -> list[float]:
    from raymoe import load_model
    from raymoe.models import causal_lm_loss

    model = load_model(directory).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(ids: torch.Tensor) -> None:
        causal_lm_loss(model(ids), ids).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return time_steps(step, data)


def raymoe_on_ray(directory: Path, layout: dict[str, int], data: list[torch.Tensor]) -> list[float]:
    import ray

    import raymoe

    if not ray.is_initialized():
        # No dashboard: on a 2-core machine its processes would compete with the two ranks.
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)

    with raymoe.from_pretrained(directory, distributed_config=layout) as model:
        model.configure_training(lr=1e-4, betas=(0.9, 0.999), max_grad_norm=None)  # the other rows: torch defaults
        return time_steps(model.train_step, data)


def transformers_torchrun(directory: Path, layout: dict[str, int], args: argparse.Namespace) -> list[float]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [
        *(sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(TORCHRUN_SCRIPT)),
        *(str(directory), json.dumps(layout), str(args.batch), str(args.seq), str(args.vocab)),
        str(args.warmup + args.steps),
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("STEP_SECONDS ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(
            f"transformers + torchrun failed for {layout}:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
        )
    return [float(x) for x in json.loads(lines[0].removeprefix("STEP_SECONDS "))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    add_shape_args(parser, heads=4, kv_heads=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    args = parser.parse_args()
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        save_checkpoint(directory, args)
        data = batches(args)
        rows = [
            ("one process", "transformers", tokens_per_s(one_process_transformers(directory, data), args)),
            ("one process", "raymoe", tokens_per_s(one_process_raymoe(directory, data), args)),
        ]
        for name in args.layouts:
            # Alternate the two systems for --rounds rounds; each keeps its best round (least disturbed).
            best = {"transformers+torchrun": 0.0, "raymoe on Ray": 0.0}
            for _ in range(args.rounds):
                torchrun_speed = tokens_per_s(transformers_torchrun(directory, LAYOUTS[name], args), args)
                ray_speed = tokens_per_s(raymoe_on_ray(directory, LAYOUTS[name], data), args)
                best["transformers+torchrun"] = max(best["transformers+torchrun"], torchrun_speed)
                best["raymoe on Ray"] = max(best["raymoe on Ray"], ray_speed)
            rows += [(name, system, speed) for system, speed in best.items()]
    print(f"\nglobal batch {args.batch}x{args.seq}, {args.experts} experts top-{args.top_k}, hidden {args.hidden}")
    print(f"{'layout':<14}{'system':<24}{'tokens/s':>10}")
    for layout, system, value in rows:
        print(f"{layout:<14}{system:<24}{value:>10.0f}")
    by_layout = {(layout, system): value for layout, system, value in rows}
    for name in args.layouts:
        ratio = by_layout[(name, "raymoe on Ray")] / by_layout[(name, "transformers+torchrun")]
        print(f"{name}: raymoe / transformers+torchrun = {ratio:.2f}")


if __name__ == "__main__":
    main()
