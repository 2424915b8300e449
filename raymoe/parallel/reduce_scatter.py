"""FSDP2's gradient reduce-scatter on gloo as one all-to-all and a local sum (CPU ranks).

gloo has no reduce-scatter of its own for one flat tensor: ``reduce_scatter_tensor`` runs an all-reduce of the whole
buffer and keeps this rank's slice (torch's profiler shows one ``gloo:all_reduce`` under each
``c10d::_reduce_scatter_base_``), so every rank moves and adds the whole gradient twice over. The same result from
an all-to-all: rank r sends chunk j of its buffer to rank j and receives chunk r of every rank's, then adds them::

    input  (every rank)  [ c0 | c1 | ... | c(n-1) ]    n chunks of the flat gradient, c_j for rank j
    all-to-all           rank r receives c_r of ranks 0..n-1, in rank order: [n, chunk]
    sum over ranks       output = c_r(rank 0) + ... + c_r(rank n-1)       [chunk]

Each rank sends and receives (n-1)/n of the buffer once, and adds n chunks instead of the whole buffer. On 2 CPU cores
(one thread per rank, best of 6 and of 10 calls in two runs of ``benchmarks/bench_reduce_scatter.py``) a 16 MiB
gradient took 7.1 ms against 14.5-15.8 ms at world 2, and 11.1-19.2 ms against 33.1-37.7 ms at world 4. The
price is a receive buffer the size of the input for the length of the call.

Sums only: raymoe's FSDP2 units sum their gradients over data-parallel ranks (:mod:`raymoe.parallel.fsdp`), the one
reduction they ask for. NCCL has a reduce-scatter of its own: CUDA ranks keep FSDP2's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter


class AllToAllReduceScatter(ReduceScatter):
    """FSDP2's ``ReduceScatter`` comm (``FSDPModule.set_custom_reduce_scatter``) as one ``all_to_all_single`` and a
    sum over the received chunks. ``input_tensor``: [n * chunk], this rank's flat gradient, chunk j for rank j;
    ``output_tensor``: [chunk], the sum over ranks of chunk ``rank``. Blocking: returns once the output holds the
    sum."""

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: object,
        async_op: bool = False,
    ) -> dist.Work | None:
        if op != dist.ReduceOp.SUM:
            raise ValueError(f"AllToAllReduceScatter sums gradients only; FSDP2 asked for {op}")
        ranks = group.size()
        received = torch.empty_like(input_tensor)
        dist.all_to_all_single(received, input_tensor, group=group)
        torch.sum(received.view(ranks, -1), dim=0, out=output_tensor)
        # Freed here, not when the last reference goes: gloo's worker thread drops its own (the call's work holds the
        # tensors) a moment after the call returns, later still on a busy CPU, while backward allocates the next
        # layer's gradients.
        received.untyped_storage().resize_(0)
        return None
