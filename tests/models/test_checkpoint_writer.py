"""Saving in the hub layout: transformers loads it bitwise; shards, index and streaming behave."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from raymoe.checkpoint import CheckpointWriter, load_model, save_model

MOE = "moe_e5_k3_gqa2_dense_mid"


def _perturbed(model):
    """Change every weight so a save that silently wrote the originals would be caught."""
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.01)
    return model


def test_transformers_loads_what_raymoe_saves_bitwise(
    tiny_name, tiny_checkpoint, load_hf_model, in_raymoe_layout, tmp_path
):
    model = _perturbed(load_model(tiny_checkpoint(tiny_name)))
    files = save_model(model, tmp_path)
    assert [f.name for f in files] == ["model.safetensors"]
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    with safe_open(tiny_checkpoint(tiny_name) / "model.safetensors", "pt") as f:
        assert keys == set(f.keys())  # the hub layout transformers itself writes (per-expert where it writes that)
    if model.config.tie_word_embeddings:
        assert "lm_head.weight" not in keys
    reference = load_hf_model(tmp_path).state_dict()
    ours = model.state_dict()
    assert ours.keys() == reference.keys()
    for name, tensor in ours.items():
        assert torch.equal(tensor, in_raymoe_layout(model.model_type, name, reference[name])), name


def test_sharded_save_with_index(tiny_checkpoint, load_hf_model, tmp_path):
    model = _perturbed(load_model(tiny_checkpoint(MOE)))
    max_shard_size = 16 * 1024
    files = save_model(model, tmp_path, max_shard_size=max_shard_size)
    assert len(files) > 2 and all(f.name.endswith(f"-of-{len(files):05d}.safetensors") for f in files)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {f.name for f in files}
    assert index["metadata"]["total_size"] == sum(p.numel() * 4 for p in model.parameters())
    for file in files:
        with safe_open(file, "pt") as f:
            sizes = [f.get_slice(k).get_shape() for k in f.keys()]  # noqa: SIM118 -- safe_open is not a dict
        total = sum(torch.Size(s).numel() * 4 for s in sizes)
        assert total <= max_shard_size or len(sizes) == 1  # a tensor larger than a shard gets one to itself
    for loaded in (load_hf_model(tmp_path).state_dict(), load_model(tmp_path).state_dict()):
        for name, tensor in model.state_dict().items():
            assert torch.equal(tensor, loaded[name]), name


def test_saving_again_removes_stale_shards(tiny_checkpoint, tmp_path):
    model = load_model(tiny_checkpoint(MOE))
    save_model(model, tmp_path, max_shard_size=16 * 1024)
    save_model(model, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    assert torch.equal(load_model(tmp_path).lm_head.weight, model.lm_head.weight)


def test_a_failed_save_keeps_the_earlier_checkpoint(tiny_checkpoint, tmp_path):
    model = load_model(tiny_checkpoint(MOE))
    save_model(model, tmp_path)
    before = (tmp_path / "model.safetensors").read_bytes()
    writer = CheckpointWriter(tmp_path, layout=model.hub_layout(), max_shard_size=16)
    with pytest.raises(RuntimeError, match="disk full"), writer:
        writer.write_parameter("lm_head.weight", model.lm_head.weight)
        writer.write_parameter("model.norm.weight", model.model.norm.weight)
        assert list(tmp_path.glob("*.partial"))  # half a save is on disk
        raise RuntimeError("disk full")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    assert (tmp_path / "model.safetensors").read_bytes() == before


def test_config_is_written_back_with_the_saved_dtype(tiny_checkpoint, tmp_path):
    directory = tiny_checkpoint(MOE)
    model = load_model(directory, dtype=torch.bfloat16)
    save_model(model, tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    original = json.loads((directory / "config.json").read_text())
    assert saved == {**original, "dtype": "bfloat16"}
    assert {p.dtype for p in load_model(tmp_path).parameters()} == {torch.bfloat16}


def test_writer_streams_shards_to_disk(tmp_path):
    writer = CheckpointWriter(tmp_path, max_shard_size=100)
    for i in range(5):
        writer.write_hub_tensor(f"t{i}", torch.full((10,), float(i)))  # 40 bytes each
    assert len(list(tmp_path.glob("*.partial"))) == 2  # t0+t1 and t2+t3 were written already
    files = writer.close()
    assert [f.name for f in files] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    with safe_open(files[2], "pt") as f:
        assert list(f.keys()) == ["t4"] and torch.equal(f.get_tensor("t4"), torch.full((10,), 4.0))


def test_writer_refuses_incomplete_or_repeated_writes(tmp_path):
    layout = {"a": "a", "b": "b"}
    writer = CheckpointWriter(tmp_path, layout=layout)
    writer.write_parameter("a", torch.zeros(2))
    with pytest.raises(ValueError, match="'a' was already written"):
        writer.write_parameter("a", torch.zeros(2))
    with pytest.raises(ValueError, match=r"1 parameters never written: \['b'\]"):
        writer.close()
    assert not list(tmp_path.glob("model*"))


def test_failed_save_leaves_no_weight_files(tmp_path):
    with pytest.raises(RuntimeError, match="boom"), CheckpointWriter(tmp_path, max_shard_size=8) as writer:
        writer.write_hub_tensor("a", torch.zeros(4))
        writer.write_hub_tensor("b", torch.zeros(4))
        raise RuntimeError("boom")
    assert not list(tmp_path.iterdir())
