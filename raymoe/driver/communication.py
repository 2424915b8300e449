"""The bytes one rank sends in one training step, by collective: an estimate from the layout, the model's shapes
and what the rank holds (``raymoe.plan`` ranks the layouts that fit by it).

    fsdp_all_gather       FSDP2 gathers each layer's weights in forward and again in backward (compute dtype;
                          once where every unit keeps them until backward: raymoe.spec.reshard)
    fsdp_reduce_scatter   and reduce-scatters its gradients (reduce dtype)
    replicate_all_reduce  HSDP: the gradient shards summed across replicas
    tp_all_reduce         the row-parallel outputs of attention and feed-forward (and masked EP's partial sums),
                          in forward and backward
    ep_all_to_all         token dispatch: every routed pair's row sent to its expert and back, forward and backward
    cp_ring               context parallelism: keys and values passed around the ring (forward, and twice in backward)

A ring collective over ``n`` ranks sends ``(n - 1) / n`` of its buffer (an all-reduce twice that).
"""

from __future__ import annotations

from dataclasses import dataclass

from raymoe.rank.contract import RankMemory
from raymoe.spec.launch import LaunchSpec
from raymoe.spec.topology import Axis


@dataclass(frozen=True)
class Communication:
    """Bytes one rank sends in one training step, by collective (an estimate from the layout and the shapes)."""

    fsdp_all_gather: int = 0  # weights gathered in forward and again in backward (or once, kept until backward)
    fsdp_reduce_scatter: int = 0  # gradients
    replicate_all_reduce: int = 0  # HSDP: gradients across replicas
    tp_all_reduce: int = 0  # activations at row-parallel outputs (masked EP's partial sums too), forward + backward
    ep_all_to_all: int = 0  # token dispatch and combine, forward + backward
    cp_ring: int = 0  # keys and values around the context-parallel ring, forward + backward

    @property
    def total(self) -> int:
        return (
            self.fsdp_all_gather
            + self.fsdp_reduce_scatter
            + self.replicate_all_reduce
            + self.tp_all_reduce
            + self.ep_all_to_all
            + self.cp_ring
        )


def communication_per_step(
    spec: LaunchSpec,
    rank: RankMemory,
    compute_bytes: int,
    reduce_bytes: int,
    seq_len: int,
    rows: int,
    keeps_gathered: bool = False,
) -> Communication:
    """Bytes one rank sends per step, by collective: ring collectives send ``(n - 1) / n`` of their buffer (twice
    for an all-reduce); FSDP2 gathers each layer in forward and again in backward (once, where every unit
    ``keeps_gathered`` its weights until backward), reduce-scatters its gradients."""
    topology, config = spec.topology, spec.config
    layout = topology.config
    tp, cp, ep = topology.axis_size(Axis.TP), topology.axis_size(Axis.CP), layout.ep_size or 1
    shard = topology.axis_size(Axis.FSDP) * cp
    replicas = topology.axis_size(Axis.DP_REPLICATE)
    layers = config.num_hidden_layers / topology.axis_size(Axis.PP)
    tokens = rows * seq_len / cp
    hidden = config.hidden_size
    gathered = rank.parameter_elements * shard * compute_bytes  # the whole (tp / ep share of the) model, gathered
    grads = rank.trainable_elements * shard * reduce_bytes
    moe_layers = sum(config.layer_is_sparse(i) for i in range(config.num_hidden_layers)) / topology.axis_size(Axis.PP)
    top_k = config.moe.num_experts_per_tok if config.moe is not None else 0
    kv_width = 2 * config.num_key_value_heads * config.head_dim / tp
    return Communication(
        fsdp_all_gather=round((1 if keeps_gathered else 2) * gathered * _ring(shard)) if shard > 1 else 0,
        fsdp_reduce_scatter=round(grads * _ring(shard)) if shard > 1 else 0,
        replicate_all_reduce=round(2 * grads / shard * _ring(replicas)) if replicas > 1 else 0,
        tp_all_reduce=round(4 * layers * 2 * tokens * hidden * compute_bytes * _ring(tp)) if tp > 1 else 0,
        ep_all_to_all=round(4 * moe_layers * tokens * top_k * hidden * compute_bytes * _ring(ep))
        if spec.plans.expert_mode == "dispatch"
        else 0,
        cp_ring=round(3 * layers * (cp - 1) * tokens * kv_width * compute_bytes) if cp > 1 else 0,
    )


def _ring(n: int) -> float:
    return (n - 1) / n
