"""Checkpoint resolution: local directories, and hub ids through a real snapshot_download on a local cache."""

from __future__ import annotations

import shutil
import subprocess
import sys

import huggingface_hub
import pytest
import torch
from huggingface_hub.utils import filter_repo_objects

from raymoe.checkpoint import HUB_ALLOW_PATTERNS, load_model, resolve_checkpoint

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def _populate_cache(cache_dir, repo_id, checkpoint):
    """The layout huggingface_hub writes: refs/main -> commit, snapshots/<commit>/<files>."""
    repo = cache_dir / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    shutil.copytree(checkpoint, repo / "snapshots" / COMMIT)
    return repo / "snapshots" / COMMIT


def test_local_directory_is_used_as_is(tiny_checkpoint):
    directory = tiny_checkpoint("qwen3_gqa4_tied")
    assert resolve_checkpoint(directory) == directory
    assert resolve_checkpoint(str(directory)) == directory


def test_local_path_errors(tmp_path):
    (tmp_path / "file.json").write_text("{}")
    with pytest.raises(ValueError, match="is a file; pass the directory"):
        resolve_checkpoint(tmp_path / "file.json")
    with pytest.raises(ValueError, match="does not exist"):
        resolve_checkpoint(tmp_path / "absent")
    with pytest.raises(ValueError, match="does not exist"):
        resolve_checkpoint("./absent")


def test_hub_id_resolves_from_the_cache_offline(offline, tmp_path, tiny_checkpoint):
    checkpoint = tiny_checkpoint("qwen3_gqa4_tied")
    snapshot = _populate_cache(tmp_path, "tiny-org/tiny-qwen3", checkpoint)
    assert resolve_checkpoint("tiny-org/tiny-qwen3", cache_dir=tmp_path) == snapshot
    model = load_model("tiny-org/tiny-qwen3", cache_dir=tmp_path)
    assert torch.equal(model.model.embed_tokens.weight, load_model(checkpoint).model.embed_tokens.weight)


def test_unknown_hub_id_offline_is_a_clear_error(offline, tmp_path):
    with pytest.raises(ValueError, match=r"cannot resolve checkpoint 'tiny-org/absent'.*LocalEntryNotFoundError"):
        resolve_checkpoint("tiny-org/absent", cache_dir=tmp_path)


def test_allow_patterns_keep_only_what_raymoe_reads():
    files = [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "model-00001-of-00016.safetensors",
        "model.safetensors.index.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "vocab.json",
        "merges.txt",
        "pytorch_model.bin",
        "pytorch_model.bin.index.json",
        "original/consolidated.00.pth",
        "README.md",
    ]
    kept = list(filter_repo_objects(files, allow_patterns=list(HUB_ALLOW_PATTERNS)))
    assert kept == files[:9]


def test_a_rank_process_does_not_import_huggingface_hub_until_it_resolves_a_hub_id():
    """Every rank imports this module and most resolve no hub id: huggingface_hub (and its HTTP stack) stays out."""
    code = "import sys, actors.rank\nprint('huggingface_hub' in sys.modules)\n"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["False"], done.stdout
