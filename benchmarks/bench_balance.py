"""What load balancing costs a training step (issue 13): the auxiliary loss + routing telemetry against neither.

The embedded demo model (``raymoe.build_tiny_checkpoint``) on the demo layout (tp2/fsdp2/ep2, 4 CPU
ranks, gloo), at several sequence lengths (``--seqs``; every row is reported). Each shape trains
the same global batches on one world (``raymoe.start_world``), the variants alternating over
``--rounds`` rounds (each round starting at another variant); each variant's figure is the best
round's median step time:

    plain        balance="none", telemetry=False     no router records, no routing metrics
    telemetry    balance="none"                      load, imbalance, dead experts, drops, the aux value
    aux          balance="aux"  (+ telemetry)        the global-batch aux loss in the objective
    aux+cap      balance="aux", capacity_factor=1.25 and token dropping

On 2 cores the distributed step (4 gloo ranks plus a Ray round trip) varies by several percent from
round to round, more than what balancing adds. So a second table times the rank-side work alone,
in this process: one rank's forward + backward of the same model and rows, with the routers recording,
the routing collected, the aux share added, and capacity on, as the variants do (without the one
small all-reduce the aux loss adds on a real world).

    .venv/bin/python benchmarks/bench_balance.py [--steps 8] [--rounds 3] [--seqs 64 128 256] [--batch 8]

Not run by the test suite.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import ray
import torch

import raymoe

DEMO_LAYOUT = {"tp_size": 2, "fsdp_size": 2, "ep_size": 2}
VARIANTS: dict[str, dict[str, Any]] = {
    "plain": {"balance": "none", "telemetry": False},
    "telemetry": {"balance": "none"},
    "aux": {"balance": "aux", "router_aux_loss_coef": 0.01},
    "aux+cap": {"balance": "aux", "router_aux_loss_coef": 0.01, "capacity_factor": 1.25},
}


def median_step_s(model: raymoe.DistributedModel, data: list[torch.Tensor], warmup: int) -> float:
    times = []
    for ids in data:
        began = time.perf_counter()
        model.train_step(ids)
        times.append(time.perf_counter() - began)
    return statistics.median(times[warmup:])


def run(checkpoint: Path, world: Any, data: list[torch.Tensor], args: argparse.Namespace) -> dict[str, float]:
    best = dict.fromkeys(VARIANTS, float("inf"))
    names = list(VARIANTS)
    with raymoe.from_pretrained(checkpoint, distributed_config=DEMO_LAYOUT, world=world) as model:
        for round_index in range(args.rounds):
            # Each round starts with another variant, so no variant always runs first (or last).
            for name in names[round_index % len(names) :] + names[: round_index % len(names)]:
                model.configure_training(lr=1e-4, **VARIANTS[name])
                best[name] = min(best[name], median_step_s(model, data, args.warmup))
    return best


def one_rank_ms(checkpoint: Path, seq: int, args: argparse.Namespace) -> dict[str, float]:
    """Best-of-rounds median of one rank's forward + backward under each variant, in this process."""
    from raymoe.checkpoint import load_model
    from raymoe.models.common.loss import causal_lm_loss
    from raymoe.models.moe.balance import aux_loss_share
    from raymoe.rank.balance import collect_routing, record_routing, routers

    model = load_model(checkpoint).train()
    gen = torch.Generator().manual_seed(1)
    rows = max(args.batch // 2, 1)  # one data-parallel rank's share of the demo layout's global batch
    ids = torch.randint(0, 256, (rows, seq), generator=gen)
    mask = torch.ones(rows * seq, dtype=torch.bool)

    def step(options: dict[str, Any]) -> None:
        record = options.get("telemetry", True)
        trains_aux = options["balance"] == "aux"
        record_routing(model, record)
        for router in routers(model):
            router.capacity_factor = options.get("capacity_factor")
        loss = causal_lm_loss(model(ids), ids, reduction="sum") / ids.numel()
        if record:
            routing = collect_routing(model, mask, with_grad=trains_aux)
            assert routing is not None
            if trains_aux:
                share = aux_loss_share(routing.prob_sum_LE, routing.counts_LE.float(), routing.tokens.float())
                loss = loss + 0.01 * share
            routing.aux_stats()
        loss.backward()
        model.zero_grad(set_to_none=True)

    best = dict.fromkeys(VARIANTS, float("inf"))
    names = list(VARIANTS)
    for round_index in range(args.rounds * 3):
        for name in names[round_index % len(names) :] + names[: round_index % len(names)]:
            times = []
            for _ in range(args.warmup + args.steps):
                began = time.perf_counter()
                step(VARIANTS[name])
                times.append(time.perf_counter() - began)
            best[name] = min(best[name], statistics.median(times[args.warmup :]))
    return {name: seconds * 1e3 for name, seconds in best.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seqs", type=int, nargs="+", default=[64, 128, 256])
    args = parser.parse_args()

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    gen = torch.Generator().manual_seed(0)
    print(f"demo model, {DEMO_LAYOUT}, batch {args.batch} rows, best of {args.rounds} rounds of {args.steps} steps")
    print(f"{'seq':>5} {'variant':<10} {'step ms':>8} {'tokens/s':>9} {'vs plain':>9}")
    with tempfile.TemporaryDirectory() as tmp, raymoe.start_world(4) as world:
        checkpoint = raymoe.build_tiny_checkpoint(Path(tmp) / "tiny")
        for seq in args.seqs:
            steps = args.warmup + args.steps
            data = [torch.randint(0, 256, (args.batch, seq), generator=gen) for _ in range(steps)]
            best = run(checkpoint, world, data, args)
            tokens = args.batch * (seq - 1)
            for name, seconds in best.items():
                ratio = best["plain"] / seconds
                print(f"{seq:>5} {name:<10} {seconds * 1e3:8.1f} {tokens / seconds:9.0f} {ratio:9.3f}", flush=True)
        torch.set_num_threads(1)  # as one rank runs
        print(f"\none rank's forward + backward in this process ({max(args.batch // 2, 1)} rows), best of rounds")
        print(f"{'seq':>5} {'variant':<10} {'ms':>8} {'vs plain':>9}")
        for seq in args.seqs:
            ms = one_rank_ms(checkpoint, seq, args)
            for name, value in ms.items():
                print(f"{seq:>5} {name:<10} {value:8.2f} {ms['plain'] / value:9.3f}", flush=True)


if __name__ == "__main__":
    main()
