"""Shared fixtures. One local Ray instance serves every multi-rank test of the session."""

import os

import pytest

# Tests never reach the network: hub code paths read local files only.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

RAY_TEST_CPUS = 8  # logical CPUs: room for the 8-rank worlds on a 2-core machine


@pytest.fixture(scope="session")
def ray_session():
    """A local Ray instance (with the state API) for the whole test session."""
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=RAY_TEST_CPUS, log_to_driver=False, include_dashboard=True)
    yield ray
    ray.shutdown()
