"""One rank of the transformers rows of bench_layouts.py: under torch.distributed.run (gloo / NCCL), or alone.

With ``layout`` ``{}`` and no torchrun it is the one-process row (transformers' grouped_mm experts, as the
distributed rows use). Each data-parallel rank trains on its rows of the same global batches bench_layouts.py
uses (with a last argument ``compile``: after ``model.compile()``, transformers' own way). Rank 0 prints the wall
time of every optimizer step as ``STEP_SECONDS [...]`` and the peak memory of every rank during the timed steps and
its memory in use when they began, as ``PEAK_MIB [[peak, start], ...]``; compiled, ``COMPILE_S`` is rank 0's seconds
spent compiling (dynamo and inductor, in the warm-up steps), as raymoe's rows report theirs.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist
import transformers
from _peak_memory import peak_mib, reset
from torch._dynamo.utils import calculate_time_spent
from transformers.distributed.configuration_utils import DistributedConfig


def main() -> None:
    directory, layout, batch, seq, vocab, steps, warmup = sys.argv[1:8]
    compiled = sys.argv[8:] == ["compile"]
    sizes = json.loads(layout)
    distributed = "RANK" in os.environ
    extra = {}
    if distributed:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        extra["distributed_config"] = DistributedConfig(**sizes)
    rank = dist.get_rank() if distributed else 0
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else None
    model = transformers.AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32, experts_implementation="grouped_mm", **extra
    ).train()
    if device is not None and not distributed:
        model.to(device)
    if compiled:
        model.compile()
    # fused, as transformers' Trainer defaults to with torch >= 2.8; one fused (or multi-tensor) group cannot mix
    # DTensors with plain tensors (tensor parallelism without FSDP leaves the norms plain): there torch's default
    fused = len({type(param) for param in model.parameters()}) == 1
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused or None)
    dp_size = sizes.get("fsdp_size", 1) * sizes.get("dp_replicate_size", 1)
    dp_rank = rank // sizes.get("tp_size", 1)
    gen = torch.Generator().manual_seed(1)
    times = []
    for step in range(int(steps)):
        if step == int(warmup):
            start = reset(device or "cpu")
        ids = torch.randint(0, int(vocab), (int(batch), int(seq)), generator=gen)
        rows = torch.tensor_split(ids, dp_size)[dp_rank]
        if device is not None:
            rows = rows.to(device)
        if distributed:
            dist.barrier()
        began = time.perf_counter()
        model(input_ids=rows, labels=rows).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if distributed:
            dist.barrier()
        elif device is not None:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - began)
    peaks = [[peak_mib(device or "cpu"), start]]
    if distributed:
        gathered: list[object] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, peaks[0])
        peaks = [list(pair) for pair in gathered]  # type: ignore[call-overload]
    if rank == 0:
        print("STEP_SECONDS " + json.dumps(times), flush=True)
        print("PEAK_MIB " + json.dumps(peaks), flush=True)
        if compiled:
            print("COMPILE_S " + json.dumps(compile_seconds()), flush=True)
    if distributed:
        dist.destroy_process_group()


def compile_seconds() -> float:
    """Seconds this process spent compiling (the figure raymoe's ``compile_seconds`` reads)."""
    return float(calculate_time_spent().get("total_wall_time", 0.0))


if __name__ == "__main__":
    main()
