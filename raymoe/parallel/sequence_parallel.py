"""Sequence parallelism inside tensor parallelism (``enable_sequence_parallel``, CFG-9; Megatron's): the residual
stream and the norms on a share of the sequence over the tp group.

Without it every rank of a tp group holds the whole ``[B, S, H]`` residual stream and runs every norm on all of it;
with it each holds ``[B, S/tp, H]``, and the decoder (:class:`~raymoe.models.common.sequence_split.ResidualSplit`)
moves between the two at the edges of each attention and feed-forward, which still see the whole sequence::

    share  [B, S, H] Replicate -> [B, S/tp, H] Shard(1)     forward: keep this rank's slice; backward: all-gather
    whole  [B, S/tp, H] Shard(1) -> [B, S, H] Replicate     forward: all-gather; backward: keep this rank's slice

The tensor-parallel styles keep the residual stream's gradient whole on every rank: a sublayer's first projections
(colwise) all-reduce their input's gradient and its last (rowwise) all-reduces its output, so ``share`` slices the
replicated output and ``whole``'s backward slices the replicated gradient, neither with a collective of its own.
That is an all-reduce plus a slice where Megatron reduce-scatters: the same activation memory, twice the bytes on
the wire at the sublayer edges. The norms' weights see a share of the tokens, so their gradients are summed over the
tp group (their ``sequence_parallel`` rules, :data:`raymoe.models.common.plans.SEQUENCE_PARALLEL_TP`).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard

from raymoe.parallel.styles.layouts import redistribute_local

SEQUENCE = Shard(1)


@dataclass(frozen=True)
class TpResidualSplit:
    """The residual stream split along the sequence over the tp group ``mesh``."""

    mesh: DeviceMesh

    def fits(self, length: int) -> bool:
        """Whether a sequence of ``length`` tokens splits into equal shares."""
        return length % self.mesh.size() == 0

    def share(self, x_BSH: Tensor) -> Tensor:
        return redistribute_local(x_BSH, self.mesh, Replicate(), SEQUENCE)

    def whole(self, x_BsH: Tensor) -> Tensor:
        return redistribute_local(x_BsH, self.mesh, SEQUENCE, Replicate())
