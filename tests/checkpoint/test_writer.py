"""Saving in the hub layout: transformers loads it bitwise; shards, index and streaming behave; a save is all or
nothing (faults injected at the OS-level calls the writer makes: the previous checkpoint stays byte for byte)."""

from __future__ import annotations

import errno
import functools
import hashlib
import json
import logging
import os
import shutil

import pytest
import torch
from safetensors import SafetensorError, safe_open

from raymoe.checkpoint import CheckpointWriter, load_model, save_model
from raymoe.checkpoint import staging as staging_module
from raymoe.checkpoint import writer as writer_module
from raymoe.checkpoint.staging import CheckpointSaveError, recover_interrupted_save

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
        assert list(writer.staging.glob("*.partial"))  # half a save is on disk, beside the checkpoint
        raise RuntimeError("disk full")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    assert (tmp_path / "model.safetensors").read_bytes() == before
    assert not writer.staging.exists()


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
    assert len(list(writer.staging.glob("*.partial"))) == 2  # t0+t1 and t2+t3 were written already
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


# --- all or nothing: faults at the OS-level calls, crash leftovers --------------------------------

SMALL_SHARDS = 16 * 1024  # bytes: the MOE checkpoint in several shards, with an index


def _hashes(directory):
    """sha256 of every file under ``directory`` by relative path: "byte for byte unchanged" is equality."""
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def _saved_before(tiny_checkpoint, tmp_path):
    """A sharded checkpoint in ``tmp_path/ckpt`` with a tokenizer beside it: the model, the target, its file hashes."""
    model = load_model(tiny_checkpoint(MOE))
    target = tmp_path / "ckpt"
    save_model(model, target, max_shard_size=SMALL_SHARDS)
    (target / "tokenizer.json").write_text('{"version": "1.0"}')
    return model, target, _hashes(target)


def _assert_unchanged(target, before, load_hf_model):
    assert _hashes(target) == before
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name]  # no staging or previous directory
    load_hf_model(target)


def test_files_the_save_does_not_own_survive_and_stale_shards_go(tiny_checkpoint, tmp_path):
    model = load_model(tiny_checkpoint(MOE))
    target = tmp_path / "ckpt"
    save_model(model, target, max_shard_size=SMALL_SHARDS)
    (target / "tokenizer.json").write_text("{}")
    (target / "README.md").write_text("# my model")
    (target / "runs").mkdir()
    (target / "runs" / "events.txt").write_text("step 1")
    (target / "latest").symlink_to("README.md")
    save_model(model, target)
    kept = ["README.md", "config.json", "latest", "model.safetensors", "runs", "tokenizer.json"]
    assert sorted(p.name for p in target.iterdir()) == kept  # the old shards and index are gone
    assert (target / "tokenizer.json").read_text() == "{}" and (target / "runs" / "events.txt").read_text() == "step 1"
    assert (target / "latest").is_symlink() and (target / "latest").read_text() == "# my model"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_a_symlinked_target_stays_a_link_to_the_new_checkpoint(tiny_checkpoint, tmp_path):
    model = load_model(tiny_checkpoint(MOE))
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to("real")
    save_model(model, tmp_path / "link")
    files = save_model(model, tmp_path / "link", max_shard_size=SMALL_SHARDS)
    assert (tmp_path / "link").is_symlink() and files[0].parent == tmp_path / "link"
    assert (tmp_path / "real" / "model.safetensors.index.json").is_file()
    assert torch.equal(load_model(tmp_path / "link").lm_head.weight, model.lm_head.weight)


def test_a_full_disk_while_writing_the_index_keeps_the_previous_checkpoint(
    tiny_checkpoint, load_hf_model, tmp_path, monkeypatch
):
    model, target, before = _saved_before(tiny_checkpoint, tmp_path)
    real_dump = json.dump

    @functools.wraps(real_dump)
    def dump(obj, fp, **kwargs):
        if getattr(fp, "name", "").endswith("model.safetensors.index.json"):
            fp.write('{"metadata": {')  # what got out before the disk filled up
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_dump(obj, fp, **kwargs)

    monkeypatch.setattr(staging_module.json, "dump", dump)
    with pytest.raises(
        CheckpointSaveError,
        match=r"could not write \S+/\.ckpt\.saving-\d+/model\.safetensors\.index\.json: "
        r"\[Errno 28\] No space left on device",
    ) as failure:
        save_model(_perturbed(model), target, max_shard_size=SMALL_SHARDS)
    assert failure.value.errno == errno.ENOSPC and isinstance(failure.value, OSError)
    _assert_unchanged(target, before, load_hf_model)


def test_a_failed_rename_into_place_puts_the_previous_checkpoint_back(
    tiny_checkpoint, load_hf_model, tmp_path, monkeypatch
):
    model, target, before = _saved_before(tiny_checkpoint, tmp_path)
    real_replace = os.replace

    def replace(source, destination):  # EIO on the rename of the staged checkpoint into place
        if os.fspath(destination) == str(target) and ".ckpt.saving-" in os.fspath(source):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real_replace(source, destination)

    monkeypatch.setattr(staging_module.os, "replace", replace)
    with pytest.raises(CheckpointSaveError, match=r"could not rename \S+\.ckpt\.saving-\d+ to \S+/ckpt: \[Errno 5\]"):
        save_model(_perturbed(model), target)
    _assert_unchanged(target, before, load_hf_model)


def test_a_short_shard_write_is_caught_before_the_swap(tiny_checkpoint, load_hf_model, tmp_path, monkeypatch):
    model, target, before = _saved_before(tiny_checkpoint, tmp_path)
    real_save_file = writer_module.save_file

    def save_file(tensors, path, metadata=None):  # a filesystem that silently drops the end of a file
        real_save_file(tensors, path, metadata=metadata)
        os.truncate(path, os.path.getsize(path) - 16)

    monkeypatch.setattr(writer_module, "save_file", save_file)
    with pytest.raises(
        CheckpointSaveError, match=r"model-00001-of-\d+\.safetensors read back is incomplete: \d+ bytes"
    ):
        save_model(_perturbed(model), target, max_shard_size=SMALL_SHARDS)
    _assert_unchanged(target, before, load_hf_model)


def test_a_failed_first_save_leaves_no_directory(tiny_checkpoint, tmp_path, monkeypatch):
    model = load_model(tiny_checkpoint(MOE))
    real_save_file, calls = writer_module.save_file, []

    def save_file(tensors, path, metadata=None):  # the second shard meets a full disk, as safetensors reports it
        calls.append(path)
        if len(calls) == 2:
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        real_save_file(tensors, path, metadata=metadata)

    monkeypatch.setattr(writer_module, "save_file", save_file)
    with pytest.raises(
        CheckpointSaveError, match=r"could not write \S+/model-00002\.safetensors\.partial: .*os error 28"
    ) as failure:
        save_model(model, tmp_path / "fresh", max_shard_size=SMALL_SHARDS)
    assert failure.value.errno == errno.ENOSPC
    assert list(tmp_path.iterdir()) == []  # no checkpoint directory, half or config-only


def test_the_next_save_recovers_what_a_crash_left(tiny_checkpoint, load_hf_model, tmp_path, caplog):
    model, target, before = _saved_before(tiny_checkpoint, tmp_path)
    # a kill between the two renames of a swap: no target, the old checkpoint whole in .ckpt.previous-<pid>,
    # the new one complete but never swapped in
    os.rename(target, tmp_path / ".ckpt.previous-4242")
    shutil.copytree(tmp_path / ".ckpt.previous-4242", tmp_path / ".ckpt.saving-4242")
    with pytest.raises(
        ValueError, match=r"did not finish left the previous checkpoint whole in \S+\.ckpt\.previous-4242"
    ):
        load_model(target)  # a load in between says where the checkpoint is
    with caplog.at_level(logging.WARNING, logger=staging_module.__name__):
        recover_interrupted_save(target)
    assert "restored the checkpoint" in caplog.text and "removed" in caplog.text
    _assert_unchanged(target, before, load_hf_model)
    # a kill while writing: a staging directory beside the target, which the next save removes
    (tmp_path / ".ckpt.saving-99999").mkdir()
    (tmp_path / ".ckpt.saving-99999" / "config.json").write_text("{}")
    save_model(model, target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    assert sorted(p.name for p in target.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]


def test_a_file_is_not_a_checkpoint_directory(tmp_path):
    (tmp_path / "ckpt").write_text("not a directory")
    with pytest.raises(CheckpointSaveError, match=r"cannot save a checkpoint into \S+/ckpt: it is a file"):
        CheckpointWriter(tmp_path / "ckpt")
