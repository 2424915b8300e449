"""One layout's training step time on Ray, as the driver sees it: for comparing two commits side by side.

    .venv/bin/python benchmarks/bench_step.py --shape many-small --layout tp2-fsdp2-ep2 [--steps 6] [--warmup 2]
        [--compile] [--masked-ep]

The model and batch are bench_layouts.py's (``--shape``), the layouts its ``LAYOUTS``; ``--compile`` compiles the
decoder blocks (``compile=True``), ``--masked-ep`` swaps the model's token dispatch for masked expert parallelism
(``ep_plan``: ``ep_router`` on the router, ``moe_tp_experts`` on the experts; ep_size must equal tp_size). Prints
the best and the median step over ``--steps`` timed steps after ``--warmup``. On a noisy machine, alternate the two
commits (``git checkout <commit> -- raymoe`` between runs: the ranks import the working tree) or the two variants, and
compare the best steps of each. Not run by the test suite.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from _model_shape import SHAPES, save_checkpoint, shape_args
from bench_layouts import LAYOUTS, world_of

MASKED_EP = {"model.layers.*.mlp.gate": "ep_router", "model.layers.*.mlp.experts": "moe_tp_experts"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default=next(iter(SHAPES)), choices=list(SHAPES))
    parser.add_argument("--layout", default="fsdp2", choices=list(LAYOUTS))
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--compile", action="store_true", help="compiled decoder blocks (default: eager on CPU)")
    parser.add_argument("--masked-ep", action="store_true", help="masked expert parallelism instead of token dispatch")
    args = parser.parse_args()
    import ray

    import raymoe

    shape, layout = shape_args(args.shape), dict[str, Any](LAYOUTS[args.layout])
    if args.masked_ep:
        layout["ep_plan"] = MASKED_EP
    gen = torch.Generator().manual_seed(1)
    data = [
        torch.randint(0, shape.vocab, (shape.batch, shape.seq), generator=gen) for _ in range(args.warmup + args.steps)
    ]
    seconds = []
    with tempfile.TemporaryDirectory() as tmp:
        save_checkpoint(Path(tmp), shape)
        ray.init(address="local", num_cpus=max(2, world_of(layout)), include_dashboard=False, log_to_driver=False)
        with raymoe.from_pretrained(tmp, distributed_config=layout, compile=args.compile or None) as model:
            model.configure_training(lr=1e-4, max_grad_norm=None)
            for ids in data[: args.warmup]:
                model.train_step(ids)
            for ids in data[args.warmup :]:
                began = time.perf_counter()
                model.train_step(ids)
                seconds.append(time.perf_counter() - began)
    variant = "".join(f" {name}" for name, on in (("compiled", args.compile), ("masked EP", args.masked_ep)) if on)
    print(
        f"{args.shape} {args.layout}{variant}: best {min(seconds):.4f} s, median {statistics.median(seconds):.4f} s "
        f"a step ({args.steps} steps after {args.warmup})"
    )


if __name__ == "__main__":
    main()
