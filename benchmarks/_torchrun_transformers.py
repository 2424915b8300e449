"""One rank of the transformers + torchrun row of bench_layouts.py (run by torch.distributed.run, gloo).

Each data-parallel rank trains on its rows of the same global batches bench_layouts.py uses;
rank 0 prints the wall time of every optimizer step as ``STEP_SECONDS [...]``.
"""

from __future__ import annotations

import json
import sys
import time

import torch
import torch.distributed as dist
import transformers
from transformers.distributed.configuration_utils import DistributedConfig


def main() -> None:
    directory, layout, batch, seq, vocab, steps = sys.argv[1:7]
    sizes = json.loads(layout)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        directory, distributed_config=DistributedConfig(**sizes), dtype=torch.float32
    ).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    dp_size = sizes.get("fsdp_size", 1) * sizes.get("dp_replicate_size", 1)
    dp_rank = rank // sizes.get("tp_size", 1)
    gen = torch.Generator().manual_seed(1)
    times = []
    for _ in range(int(steps)):
        ids = torch.randint(0, int(vocab), (int(batch), int(seq)), generator=gen)
        rows = torch.tensor_split(ids, dp_size)[dp_rank]
        dist.barrier()
        began = time.perf_counter()
        model(input_ids=rows, labels=rows).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        dist.barrier()
        times.append(time.perf_counter() - began)
    if rank == 0:
        print("STEP_SECONDS " + json.dumps(times), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
