"""Which FSDP2 units keep their gathered weights from forward to backward on this rank (``DistributedConfig``'s
``fsdp_reshard_after_forward``, the rule in :mod:`raymoe.spec.reshard`), decided once per load.

Under ``auto`` each rank compares what its units gather against the memory its device has free, and every rank takes
the most careful answer (one all-reduce): a unit whose ranks disagreed would gather in backward on some of them only.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from raymoe.models.common.decoder import CausalLM
from raymoe.parallel.fsdp import gathered_bytes, keep_gathered_after_forward
from raymoe.rank.context import RankContext
from raymoe.spec.reshard import ReshardChoice, keeps_every_unit, keeps_last_layer


def keep_gathered_weights(ctx: RankContext, parts: list[CausalLM], choice: ReshardChoice) -> bool:
    """Set which units of ``parts`` (FSDP2 applied, still on meta) keep their gathered weights until backward;
    returns whether every unit does. Every rank of the world calls it (``auto`` agrees by one all-reduce)."""
    every = keeps_every_unit(choice, sum(gathered_bytes(part) for part in parts), free_memory(ctx))
    if choice == "auto" and ctx.world_size > 1:
        agreed = torch.tensor(int(every), device=ctx.device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
        every = bool(agreed.item())
    for part in parts:
        keep_gathered_after_forward(part, every_unit=every, last_layer=keeps_last_layer(choice))
    return every


def free_memory(ctx: RankContext) -> int:
    """Bytes this rank may count on: its GPU's free memory, or on CPU the host's available memory shared by every
    rank of the world (as if all ran on this host: on several hosts that undercounts, which only keeps less)."""
    if ctx.device.type == "cuda":
        return int(torch.cuda.mem_get_info(ctx.device)[0])
    return _host_available() // ctx.world_size


def _host_available() -> int:
    """The host's available memory (``MemAvailable``: free pages and what the kernel can reclaim), or its free pages
    where ``/proc/meminfo`` is missing."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
