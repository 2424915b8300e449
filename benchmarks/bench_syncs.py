"""Host syncs of a training step and of decoding, per layout (issue 36's budget), counted by raymoe's meter.

    .venv/bin/python benchmarks/bench_syncs.py            # the embedded tiny Qwen3-MoE, worlds of 1 and 4

For each layout, on every rank: the device -> host syncs of the second of two training steps of 2 micro-batches
(``raymoe.rank.host_syncs.HostSyncs``: scalar reads, ``.tolist()``, ``.cpu()``, blocking copies, data-shaped ops)
and of one ``generate_tokens`` of 8 tokens, with the sites of rank 0. On CPU the meter counts the calls that
would wait on a GPU; on a GPU ``benchmarks/gpu_check.sh`` counts CUDA's own. Run it from an older checkout (with
``PYTHONPATH`` at it and this file's meter copied in) for the figures before a change.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from ray import cloudpickle

import raymoe

cloudpickle.register_pickle_by_value(sys.modules[__name__])

LAYOUTS: dict[str, dict[str, Any]] = {
    "world1": {},
    "fsdp4": {"fsdp_size": 4},
    "tp2-fsdp2": {"tp_size": 2, "fsdp_size": 2},
    "fsdp4-ep4 (token dispatch)": {"fsdp_size": 4, "ep_size": 4},
    "tp2-pp2": {"tp_size": 2, "pp_size": 2},
}
MICRO, NEW_TOKENS = 2, 8


def counted_step(ctx: Any) -> tuple[int, dict[str, int]]:
    import torch

    from raymoe.rank.contract import MicroBatch
    from raymoe.rank.host_syncs import HostSyncs
    from raymoe.rank.train import train_step

    ids = torch.randint(0, 256, (8, 16), generator=torch.Generator().manual_seed(0))
    micro = MicroBatch(ids, ids.clone(), torch.ones_like(ids, dtype=torch.bool))
    tokens = MICRO * ids.numel() * ctx.topology.world_size
    train_step(ctx, [micro] * MICRO, tokens)  # the first step of a shape sets a pipeline up
    with HostSyncs() as syncs:
        train_step(ctx, [micro] * MICRO, tokens)
    return syncs.count, dict(syncs.sites)


def counted_decode(ctx: Any) -> tuple[int, dict[str, int]]:
    import torch

    from raymoe.models.common.generation import SamplingConfig, StopRules
    from raymoe.rank.contract import DecodeRequest
    from raymoe.rank.host_syncs import HostSyncs
    from raymoe.rank.infer import generate_tokens

    ids = torch.randint(1, 256, (2, 6), generator=torch.Generator().manual_seed(0))
    request = DecodeRequest(NEW_TOKENS, SamplingConfig(do_sample=True, seed=3), StopRules(eos_ids=(), pad_id=0))
    with HostSyncs() as syncs:
        generate_tokens(ctx, ids, None, torch.arange(2), request)
    return syncs.count, dict(syncs.sites)


def main() -> None:
    from raymoe.rank.local import LocalRankGroup

    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = raymoe.build_tiny_checkpoint(Path(tmp) / "tiny")
        world = raymoe.start_world(4)
        try:
            for name, layout in LAYOUTS.items():
                config = raymoe.DistributedConfig(**layout)
                ranks = LocalRankGroup() if config.world_size == 1 else world
                with raymoe.from_pretrained(checkpoint, distributed_config=config, world=ranks) as model:
                    model.configure_training(lr=1e-3, balance="none" if config.pp_size > 1 else "auto")
                    steps = model.run_on_ranks(counted_step)
                    decodes = model.run_on_ranks(counted_decode)
                if config.world_size == 1:
                    ranks.shutdown()
                results[name] = {"step": [c for c, _ in steps], "decode": [c for c, _ in decodes]}
                print(f"{name}: per step {results[name]['step']}, per {NEW_TOKENS} tokens {results[name]['decode']}")
                print(f"    step sites (rank 0): {steps[0][1]}\n    decode sites (rank 0): {decodes[0][1]}")
        finally:
            world.shutdown()
    print(json.dumps(results))


if __name__ == "__main__":
    main()
