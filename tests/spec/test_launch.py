"""prepare_launch on the driver: a local checkpoint's files are checked from their headers before any actor starts."""

from __future__ import annotations

import shutil
import time

import pytest
from safetensors.torch import load_file, save_file

from raymoe.spec.launch import prepare_launch

MOE = "moe_e8_k2_mha"


@pytest.fixture
def copy_of(tiny_checkpoint, tmp_path):
    """A writable copy of a tiny checkpoint."""
    target = tmp_path / "checkpoint"
    shutil.copytree(tiny_checkpoint(MOE), target)
    return target


def test_a_good_checkpoint_passes_quickly(copy_of):
    began = time.perf_counter()
    spec = prepare_launch(copy_of, {"fsdp_size": 2, "ep_size": 2})
    assert spec.topology.world_size == 2 and time.perf_counter() - began < 5


def test_a_truncated_file_is_named_with_its_size(copy_of):
    weights = copy_of / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ValueError, match=r"model.safetensors \(\d+ bytes\) is not a readable safetensors file.*trunc"):
        prepare_launch(copy_of)


def test_missing_and_wrong_shape_tensors_are_listed(copy_of):
    state = load_file(copy_of / "model.safetensors")
    del state["model.layers.0.self_attn.q_proj.weight"]
    state["model.norm.weight"] = state["model.norm.weight"][:-1].clone()
    save_file(state, copy_of / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError) as raised:
        prepare_launch(copy_of)
    message = str(raised.value)
    assert "missing (1): model.layers.0.self_attn.q_proj.weight" in message
    assert "model.norm.weight: checkpoint (63,), model (64,)" in message


def test_a_bin_only_directory_and_invalid_json_say_so(copy_of):
    (copy_of / "model.safetensors").rename(copy_of / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"it has pytorch_model.bin: raymoe reads safetensors checkpoints only"):
        prepare_launch(copy_of)
    (copy_of / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config.json is not valid JSON"):
        prepare_launch(copy_of)
