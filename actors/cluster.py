"""Connecting the driver to Ray: the cluster it runs in, or a local instance sized to the world.

ray already initialised in this process        use it as is
RAY_ADDRESS set (e.g. inside `ray job submit`)  connect there
a cluster started on this machine (ray start)   connect to it ("auto")
none                                            start a local instance with enough CPUs for the ranks
"""

from __future__ import annotations

import logging
import os

import ray
import torch

logger = logging.getLogger(__name__)


def connect(num_ranks: int, cpus_per_rank: float) -> None:
    """Make sure this driver is connected to a Ray cluster; rank actors' output stays off the driver."""
    if ray.is_initialized():
        return
    address = os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=False)
        return
    try:
        ray.init(address="auto", log_to_driver=False)
        return
    except ConnectionError:
        pass
    num_cpus = max(os.cpu_count() or 1, int(num_ranks * cpus_per_rank + 0.999))
    logger.info("starting a local Ray instance with %d CPUs for %d ranks", num_cpus, num_ranks)
    ray.init(num_cpus=num_cpus, num_gpus=torch.cuda.device_count(), log_to_driver=False)


def cluster_gpus() -> int:
    """Total GPUs of the connected cluster."""
    return int(ray.cluster_resources().get("GPU", 0))
