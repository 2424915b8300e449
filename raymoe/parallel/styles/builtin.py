"""The built-in style names of the SPEC §4 table, each with its configured instance."""

from __future__ import annotations

from torch.distributed.tensor import Replicate

from raymoe.parallel.styles.base import ParallelStyle
from raymoe.parallel.styles.expert import EpDispatchExpertsParallel, EpRouterParallel, GroupedGemmParallel
from raymoe.parallel.styles.moe import MoeExpertsParallel, MoeIdentityParallel
from raymoe.parallel.styles.tensor import (
    AllReduceParallel,
    ColwiseParallel,
    EmbeddingParallel,
    LocalParamsParallel,
    MlaKvAProjParallel,
    PackedColwiseParallel,
    PackedRowwiseParallel,
    ReplicatedWithGradAllReduce,
    RowwiseParallel,
    SequenceParallel,
)


def builtin_styles() -> dict[str, ParallelStyle]:
    """Fresh instances of every built-in style. ``ep_dispatch_experts`` is unbound (tp = 1); a rank with
    tp > 1 applies ``style.bind_tp(its tp mesh)``."""
    return {
        "embedding_rowwise": EmbeddingParallel(shard_dim=0),
        "embedding_colwise": EmbeddingParallel(shard_dim=1),
        "colwise": ColwiseParallel(),
        "colwise_gather_output": ColwiseParallel(output_layout=Replicate()),
        "colwise_rep": ColwiseParallel(output_layout=Replicate()),
        "rowwise": RowwiseParallel(),
        "rowwise_split_input": RowwiseParallel(input_layout=Replicate()),
        "rowwise_rep": RowwiseParallel(input_layout=Replicate()),
        "packed_colwise": PackedColwiseParallel(split_factor=2),
        "packed_rowwise": PackedRowwiseParallel(split_factor=2),
        "sequence_parallel": SequenceParallel(sequence_dim=1),
        "replicated_with_grad_allreduce": ReplicatedWithGradAllReduce(),
        "mla_kv_a_proj": MlaKvAProjParallel(),
        "all_reduce": AllReduceParallel(),
        "moe_tp_experts": MoeExpertsParallel(),
        "moe_identity_expert": MoeIdentityParallel(),
        "local_params": LocalParamsParallel(),
        "grouped_gemm": GroupedGemmParallel(),
        "ep_router": EpRouterParallel(),
        "ep_dispatch_experts": EpDispatchExpertsParallel(),
    }
