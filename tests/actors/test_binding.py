"""Ranks placed without GPUs: their GPUs are hidden before torch starts, and they run gloo on the CPU (a local Ray)."""

import sys

from ray import cloudpickle

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def rank_devices(ctx):
    """What this rank's process sees: ``CUDA_VISIBLE_DEVICES``, torch's GPU count, its backend and device."""
    import os

    import torch

    return os.environ.get("CUDA_VISIBLE_DEVICES"), torch.cuda.device_count(), ctx.backend, str(ctx.device)


def test_ranks_placed_without_gpus_see_none_and_run_gloo(world):
    assert world(2).execute(rank_devices) == [("", 0, "gloo", "cpu")] * 2
