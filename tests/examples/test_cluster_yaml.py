"""cluster.yaml passes Ray's own cluster-launcher validation (what `ray up` runs before touching a cloud)."""

from __future__ import annotations

import copy
from pathlib import Path

import jsonschema
import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

CLUSTER_YAML = Path(__file__).resolve().parents[2] / "cluster.yaml"


@pytest.fixture(scope="module")
def raw() -> dict:
    return yaml.safe_load(CLUSTER_YAML.read_text())


def test_cluster_yaml_is_valid_for_ray_up(raw):
    # `ray up` fills in the provider's defaults (prepare_config), then validates against ray-schema.json.
    prepared = prepare_config(copy.deepcopy(raw))
    validate_config(prepared)
    assert prepared["head_node_type"] == "head"
    workers = prepared["available_node_types"]["gpu8"]
    assert workers["min_workers"] == workers["max_workers"] == prepared["max_workers"]  # N fixed GPU nodes
    assert "p5.48xlarge" in workers["node_config"]["InstanceType"]
    assert prepared["available_node_types"]["head"]["max_workers"] == 0


def test_the_validator_rejects_a_misspelled_field(raw):
    broken = copy.deepcopy(raw)
    broken["available_node_types"]["gpu8"]["min_wrokers"] = 1
    with pytest.raises(jsonschema.ValidationError, match="min_wrokers"):
        validate_config(prepare_config(broken))


def test_token_auth_on_every_node_and_dashboard_on_loopback_only(raw):
    head, worker = raw["head_start_ray_commands"], raw["worker_start_ray_commands"]
    starts = [c for c in head + worker if "ray start" in c]
    assert len(starts) == 2 and all(c.startswith("RAY_AUTH_MODE=token ray start") for c in starts)
    assert "--dashboard-host=127.0.0.1" in next(c for c in head if "ray start" in c)
    assert raw["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"


def test_setup_installs_raymoe_with_the_pinned_constraints(raw):
    assert raw["file_mounts"]["~/raymoe"] == "."
    install = raw["setup_commands"][0]
    assert "pip install" in install and "-c ~/raymoe/constraints.txt" in install and install.endswith("-e ~/raymoe")
    assert ".venv" in raw["rsync_exclude"]
