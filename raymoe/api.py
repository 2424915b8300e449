"""``raymoe.from_pretrained``: the one call that validates, places the ranks and loads the shards."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch

from raymoe.config import DistributedConfig
from raymoe.launch import as_config, prepare_launch
from raymoe.runtime import Backend

if TYPE_CHECKING:
    from actors.handle import DistributedModel


def from_pretrained(
    name_or_path: str | os.PathLike[str],
    *,
    distributed_config: DistributedConfig | dict[str, Any] | None = None,
    dtype: torch.dtype | str | None = None,
    world_size: int | None = None,
    revision: str | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    use_gpu: bool | None = None,
    cpus_per_rank: float = 1.0,
    backend: Backend | None = None,
    placement_timeout_s: float = 120.0,
    collective_timeout_s: float = 1800.0,
) -> DistributedModel:
    """Load ``name_or_path`` (a local directory or a hub id) sharded over Ray rank actors.

    Everything that can be checked without a cluster (config, plans, the checkpoint's
    config.json) is checked first; then Ray is joined (``RAY_ADDRESS``, a cluster started on
    this machine, or a new local instance), the cluster is checked for room, one actor per
    rank is placed and each rank loads only its shard. ``use_gpu=None`` uses GPUs when the
    cluster has any. ``world_size`` is only needed with ``tp_plan="auto"`` and no ``tp_size``;
    it defaults then to the cluster's GPU count.
    """
    from actors.cluster import cluster_gpus, connect
    from actors.group import GroupOptions
    from actors.handle import DistributedModel

    config = as_config(distributed_config)
    if config.tp_is_deferred and world_size is None:
        connect(num_ranks=1, cpus_per_rank=cpus_per_rank)
        world_size = cluster_gpus()
        if world_size == 0:
            raise ValueError(
                "tp_plan='auto' without tp_size takes the world size from the cluster's GPUs, and it has "
                "none; pass world_size= or set tp_size"
            )
    spec = prepare_launch(
        name_or_path, config, world_size=world_size, dtype=dtype, revision=revision, cache_dir=cache_dir
    )
    connect(num_ranks=spec.topology.world_size, cpus_per_rank=cpus_per_rank)
    gpu = use_gpu if use_gpu is not None else cluster_gpus() > 0
    options = GroupOptions(
        use_gpu=gpu,
        cpus_per_rank=cpus_per_rank,
        backend=backend,
        placement_timeout_s=placement_timeout_s,
        collective_timeout_s=collective_timeout_s,
    )
    return DistributedModel.launch(spec, options)
