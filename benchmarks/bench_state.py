"""Training-state speed (issue 16): save_state / load_state time and bytes per rank, sync vs async, and the step
time while an asynchronous save writes.

Two shapes of the embedded demo model (Qwen3-MoE, 8 experts): ``demo`` (its own sizes) and ``wide`` (hidden 512,
experts of 512, 4 layers), each loaded with ``fsdp_size=2`` on two rank actors. Per shape, in alternating rounds
(best of ``--rounds``):

    save_pretrained        gathered hub checkpoint, written by rank 0 (for comparison)
    save_state sync        every rank writes its shards (DCP); returns when the state is swapped in
    save_state async       returns once the shards are copied to CPU memory ("blocking"), then
                           wait_for_save() returns when written and swapped in ("until durable")
    load_state             same layout, and into tp_size=2 (another layout)
    train step             median step time alone, and the first step issued right after an async save

Bytes: each rank's ``__<rank>_0.distcp`` file and the whole state directory. On this 2-core CPU machine the
absolute numbers are small and noisy: compare the ratios of one run.

    .venv/bin/python benchmarks/bench_state.py [--rounds 3] [--shapes demo wide]

Not run by the test suite.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import raymoe
from raymoe import DistributedConfig
from raymoe.checkpoint.model_io import save_model
from raymoe.driver.tiny import TINY_MOE_CONFIG
from raymoe.models.registry import build_model, parse_model_config

SHAPES: dict[str, dict[str, Any]] = {
    "demo": {},
    "wide": {"hidden_size": 512, "moe_intermediate_size": 512, "intermediate_size": 1024, "num_hidden_layers": 4,
             "head_dim": 128},
}  # fmt: skip
ROWS, SEQ = 8, 64


def build_checkpoint(directory: Path, shape: str) -> Path:
    config = parse_model_config(TINY_MOE_CONFIG | SHAPES[shape])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = build_model(config, device="cpu")
    save_model(model, directory)
    return directory


def timed(fn) -> tuple[float, Any]:
    began = time.perf_counter()
    result = fn()
    return time.perf_counter() - began, result


def batch(seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (ROWS, SEQ), generator=torch.Generator().manual_seed(seed))


def one_round(model, other, work: Path, round_index: int) -> dict[str, float]:
    out: dict[str, float] = {}
    steps = [timed(lambda i=i: model.train_step(batch(i)))[0] for i in range(3)]
    out["step alone (s)"] = statistics.median(steps)
    out["save_pretrained (s)"], _ = timed(lambda: model.save_pretrained(work / f"hub-{round_index}"))
    sync = work / f"sync-{round_index}"
    out["save_state sync (s)"], _ = timed(lambda: model.save_state(sync))
    began = time.perf_counter()
    model.save_state(work / f"async-{round_index}", async_save=True)
    out["save_state async, blocking (s)"] = time.perf_counter() - began
    out["step during async save (s)"], _ = timed(lambda: model.train_step(batch(99)))
    model.wait_for_save()
    out["save_state async, until durable (s)"] = time.perf_counter() - began
    out["load_state same layout (s)"], _ = timed(lambda: model.load_state(sync))
    out["load_state into tp2 (s)"], _ = timed(lambda: other.load_state(sync))
    for rank in range(2):
        out[f"bytes rank {rank}"] = float((sync / f"__{rank}_0.distcp").stat().st_size)
    out["bytes state total"] = float(sum(p.stat().st_size for p in sync.iterdir()))
    out["bytes hub checkpoint"] = float(sum(p.stat().st_size for p in (work / f"hub-{round_index}").iterdir()))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    args = parser.parse_args()
    import ray

    ray.init(num_cpus=8, log_to_driver=False)  # room for the fsdp2 world and the tp2 model beside it
    world = raymoe.start_world(2)
    try:
        for shape in args.shapes:
            with tempfile.TemporaryDirectory() as tmp:
                work = Path(tmp)
                checkpoint = build_checkpoint(work / "ckpt", shape)
                rounds = []
                for index in range(args.rounds):
                    with raymoe.from_pretrained(
                        checkpoint, distributed_config=DistributedConfig(fsdp_size=2), world=world
                    ) as model:
                        model.configure_training(lr=1e-4)
                        # load_state into another layout needs a second model: on its own world, loaded after
                        results = one_round_with_other(model, checkpoint, work, index)
                    rounds.append(results)
                params = sum(
                    p.numel() for p in build_model(parse_model_config(TINY_MOE_CONFIG | SHAPES[shape])).parameters()
                )
                print(
                    f"\n## shape {shape}: {params / 1e6:.2f} M parameters, fsdp_size=2 (2 ranks), best of {args.rounds}"
                )
                for key in rounds[0]:
                    values = [r[key] for r in rounds]
                    best = max(values) if key.startswith("bytes") else min(values)
                    shown = f"{best / 1e6:.2f} MB" if key.startswith("bytes") else f"{best:.3f}"
                    print(f"  {key:40s} {shown}")
    finally:
        world.shutdown()


def one_round_with_other(model, checkpoint: Path, work: Path, index: int) -> dict[str, float]:
    other = raymoe.from_pretrained(checkpoint, distributed_config=DistributedConfig(tp_size=2))
    try:
        return one_round(model, other, work, index)
    finally:
        other.shutdown()


if __name__ == "__main__":
    main()
