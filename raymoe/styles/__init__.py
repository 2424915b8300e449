"""Parallel styles: the base class, the registry plans name them through, and the built-in styles.

Importing this package registers the built-in styles into :data:`STYLES` (one explicit call below,
the table of every built-in name). The reference's DeepGEMM Mega-MoE styles need that GPU kernel
(SPEC STYLE-3) and stay unregistered.

The registered ``ep_dispatch_experts`` is the tp = 1 instance; with tp > 1 a rank applies an instance
bound to its own tp group, ``EpDispatchExpertsParallel(tp_mesh=ctx.mesh("tp"))``.
"""

from torch.distributed.tensor import Replicate

from raymoe.styles.base import ParallelStyle
from raymoe.styles.expert import EpDispatchExpertsParallel, EpRouterParallel, GroupedGemmParallel
from raymoe.styles.moe import MoeExpertsParallel, MoeIdentityParallel
from raymoe.styles.registry import STYLES, StyleRegistry, register
from raymoe.styles.tensor import (
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

__all__ = ["STYLES", "ParallelStyle", "StyleRegistry", "register"]


def builtin_styles() -> dict[str, ParallelStyle]:
    """Every built-in style name of the SPEC §4 table with its configured instance."""
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


def _register_builtin_styles(registry: StyleRegistry) -> None:
    for name, style in builtin_styles().items():
        registry.register(name, style)


_register_builtin_styles(STYLES)
