"""Routing telemetry on the driver: tokens per expert and per rank from each batch's loads."""

from __future__ import annotations

import torch

from raymoe import DistributedConfig
from raymoe.driver.routing import expert_load_metrics
from raymoe.spec.topology import build_topology


def test_rank_load_counts_the_batches_of_each_ep_group():
    topology = build_topology(DistributedConfig(fsdp_size=4, ep_size=2))  # ep groups (0, 1), (2, 3)
    loads = [torch.tensor([[1, 2, 3, 4]]) * (b + 1) for b in range(4)]  # batch b: b+1 times [1, 2, 3, 4]
    metrics = expert_load_metrics(loads, topology)
    assert metrics["expert_load"] == [[10, 20, 30, 40]]
    # rank 0 holds experts 0-1 and sees batches 0 and 1: (1 + 2) * (1 + 2); rank 3 experts 2-3 of batches 2, 3
    assert metrics["rank_load"] == [[9, 21, 21, 49]]


def test_under_context_parallelism_a_group_holding_part_of_a_batch_counts_its_share():
    # cp4, ep2: each ep group holds two of the batch's four cp ranks, so half of its tokens
    topology = build_topology(DistributedConfig(cp_size=4, ep_size=2))
    metrics = expert_load_metrics([torch.tensor([[8, 8, 4, 4]])], topology)
    assert metrics["rank_load"] == [[8, 4, 8, 4]]  # half of 16 and of 8
    whole = build_topology(DistributedConfig(cp_size=2, ep_size=2))  # the ep group holds the whole batch
    assert expert_load_metrics([torch.tensor([[8, 8, 4, 4]])], whole)["rank_load"] == [[16, 8]]
