"""Storage URLs (raymoe.checkpoint.storage, committed, upload) against a local S3-compatible server (moto) via s3fs."""

from __future__ import annotations

import json
from pathlib import Path

import fsspec
import pytest

from raymoe.checkpoint.committed import (
    COMMIT_FILE,
    CommitError,
    commit,
    committed,
    generations,
    new_generation,
    remove_uncommitted,
)
from raymoe.checkpoint.staging import CheckpointSaveError
from raymoe.checkpoint.storage import StorageUrl, check_reachable, location_of, storage_url
from raymoe.checkpoint.upload import upload_directory
from raymoe.driver.local_paths import storage_path


def test_a_url_is_checked_and_parsed():
    url = storage_url("s3://bucket/run/state/", "save_state path", write=True)
    assert url == StorageUrl("s3", "bucket/run/state")
    assert str(url) == "s3://bucket/run/state"
    assert url.join("g-1", "x") == StorageUrl("s3", "bucket/run/state/g-1/x")
    assert url.parent == StorageUrl("s3", "bucket/run") and url.name == "state"
    assert location_of(str(url)) == url
    assert location_of("/data/run") == Path("/data/run")


def test_bad_urls_are_one_clear_error():
    with pytest.raises(ValueError, match=r"save_state path='nosuch://b/x': nosuch:// is not a filesystem fsspec"):
        storage_url("nosuch://b/x", "save_state path", write=True)
    with pytest.raises(ValueError, match=r"names no bucket or path after s3://"):
        storage_url("s3://", "save_state path", write=True)
    with pytest.raises(ValueError, match=r"raymoe reads hf:// URLs but does not write them"):
        storage_url("hf://org/model", "save_pretrained path", write=True)
    assert storage_url("hf://org/model", "from_pretrained", write=False) == StorageUrl("hf", "org/model")


def test_a_missing_filesystem_package_is_named():
    pytest.importorskip("s3fs")
    try:
        import gcsfs  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("gcsfs is installed here")
    with pytest.raises(ValueError, match=r"save_state path='gs://b/x': gs:// URLs need the gcsfs package"):
        storage_url("gs://b/x", "save_state path", write=True)


def test_reachability_is_checked_on_the_driver(s3_bucket, monkeypatch):
    bucket = s3_bucket.removeprefix("s3://")
    check_reachable(StorageUrl("s3", f"{bucket}/new/run"), "save_state path", write=True)
    with pytest.raises(ValueError, match=r"its bucket or container 'no-such-bucket-x' does not exist"):
        storage_path("s3://no-such-bucket-x/run", "save_state path", write=True)
    with pytest.raises(ValueError, match=rf"state path='s3://{bucket}/absent': it does not exist"):
        storage_path(f"s3://{bucket}/absent", "state path", write=False)
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    fsspec.get_filesystem_class("s3").clear_instance_cache()
    try:
        with pytest.raises(ValueError, match=r"cannot reach s3:// storage: NoCredentialsError"):
            storage_path(f"s3://{bucket}/run", "save_state path", write=True)
    finally:
        fsspec.get_filesystem_class("s3").clear_instance_cache()


def test_a_commit_marker_names_the_generation_readers_see(s3_bucket):
    target = storage_url(f"{s3_bucket}/state", "t", write=True)
    fs = target.filesystem()
    assert committed(target) is None and generations(target) == []
    first = new_generation(target)
    fs.pipe_file(first.join("data").path, b"one")
    assert committed(target) is None  # written, not committed
    commit(target, first)
    assert committed(target) == first
    second = new_generation(target)
    fs.pipe_file(second.join("data").path, b"two")
    assert committed(target) == first  # interrupted before its marker: the first is still what readers see
    assert fs.cat_file(committed(target).join("data").path) == b"one"
    commit(target, second)
    assert committed(target) == second and generations(target) == [second]  # the replaced one removed
    leftover = new_generation(target)
    fs.pipe_file(leftover.join("data").path, b"never committed")
    assert remove_uncommitted(target) == [leftover] and generations(target) == [second]
    fs.pipe_file(target.join(COMMIT_FILE).path, json.dumps({"format": "other"}).encode())
    with pytest.raises(CommitError, match=r"is not a raymoe commit marker"):
        committed(target)


def test_an_upload_puts_every_file_and_drops_stale_shards(s3_bucket, tmp_path):
    target = storage_url(f"{s3_bucket}/ckpt", "t", write=True)
    fs = target.filesystem()
    first = tmp_path / "first"
    first.mkdir()
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        (first / name).write_bytes(b"w" * 10)
    (first / "model.safetensors.index.json").write_text("{}")
    (first / "config.json").write_text("{}")
    upload_directory(first, target)
    fs.pipe_file(target.join("tokenizer.json").path, b"{}")  # a file the checkpoint does not write: kept
    second = tmp_path / "second"
    second.mkdir()
    (second / "model.safetensors").write_bytes(b"one shard")
    (second / "config.json").write_text('{"new": 1}')
    upload_directory(second, target)
    fs.invalidate_cache()
    names = sorted(Path(p).name for p in fs.ls(target.path, detail=False))
    assert names == ["config.json", "model.safetensors", "tokenizer.json"]
    assert fs.cat_file(target.join("config.json").path) == b'{"new": 1}'


def test_a_failed_upload_is_a_checkpoint_save_error(s3_server, tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointSaveError, match=r"could not upload the checkpoint to s3://no-such-bucket-y/ckpt"):
        upload_directory(tmp_path, StorageUrl("s3", "no-such-bucket-y/ckpt"))
