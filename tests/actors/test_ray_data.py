"""The Ray Data engine on a real local Ray (actors/ray_data.py): the same records give the same rows, labels and
document ids as the driver engine, for text and chat JSONL, Parquet, a ``datasets`` directory and a user's
``ray.data.Dataset``; and a bad engine is one error before any work."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import raymoe
from raymoe.driver.tiny import tiny_tokenizer

WINDOW = 16


def _chat(count: int) -> list[dict]:
    return [
        {
            "messages": [
                {"role": "user", "content": "q" * (i * 7 % 23 + 1)},
                {"role": "assistant", "content": "a" * (i % 9 + 1)},
            ]
        }
        for i in range(count)
    ]


def _text(count: int) -> list[dict]:
    return [{"text": "doc " + "t" * (i * 11 % 37)} for i in range(count)]


def _same(a: raymoe.PackedData, streamed: raymoe.StreamedData) -> None:
    """The rows stay in the object store: only their references and counts are here; collected, they are the
    driver engine's rows."""
    assert isinstance(streamed, raymoe.StreamedData)
    assert streamed.num_sequences == a.num_sequences and streamed.num_label_tokens == a.num_label_tokens
    b = streamed.collect()
    for name in ("input_ids", "attention_mask", "document_ids"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            assert torch.equal(x, y), name
    assert (a.labels is None) == (b.labels is None)
    if a.labels is not None:  # a block keeps the targets; for chat rows they are the labels
        assert torch.equal(a.labels, b.labels)
    assert torch.equal(a.targets(), b.targets())


@pytest.mark.parametrize("kind", ["text", "chat"])
def test_jsonl_gives_the_driver_engines_rows(ray_session, tmp_path, kind):
    records = _chat(45) if kind == "chat" else _text(45)
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    tokenizer = tiny_tokenizer()
    driver = raymoe.load_dataset(path, 96, tokenizer, cache_dir=False, pack_window=WINDOW)
    ray = raymoe.load_dataset(path, 96, tokenizer, engine="ray", pack_window=WINDOW)
    _same(driver, ray)
    assert ray.report.examples == 45 and ray.report.rows == ray.num_sequences
    assert ray.report.label_tokens == driver.num_label_tokens


def test_parquet_and_a_datasets_directory_give_the_driver_engines_rows(ray_session, tmp_path):
    datasets = pytest.importorskip("datasets")
    records = _chat(40)
    tokenizer = tiny_tokenizer()
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "chat.parquet", row_group_size=7)
    driver = raymoe.load_dataset(tmp_path / "chat.parquet", 96, tokenizer, cache_dir=False, pack_window=WINDOW)
    _same(driver, raymoe.load_dataset(tmp_path / "chat.parquet", 96, tokenizer, engine="ray", pack_window=WINDOW))
    saved = tmp_path / "saved"
    datasets.Dataset.from_list(records).save_to_disk(str(saved))
    _same(driver, raymoe.load_dataset(saved, 96, tokenizer, engine="ray", pack_window=WINDOW))


def test_from_ray_dataset_packs_a_users_dataset(ray_session, tmp_path):
    records = _chat(30)
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    tokenizer = tiny_tokenizer()
    driver = raymoe.load_dataset(path, 96, tokenizer, cache_dir=False, pack_window=WINDOW)
    ds = ray_session.data.from_items(records)
    _same(driver, raymoe.from_ray_dataset(ds, tokenizer=tokenizer, seq_len=96, pack_window=WINDOW))


def test_bad_engines_and_options_are_one_clear_error(tmp_path):
    with pytest.raises(ValueError, match=r"engine='spark': choose 'driver' \(the default\) or 'ray'"):
        raymoe.load_dataset(tmp_path / "missing.jsonl", 96, tiny_tokenizer(), engine="spark")
    with pytest.raises(ValueError, match=r"pre-tokenized \(\.npy\).*use engine='driver'"):
        raymoe.load_dataset(tmp_path / "a.npy", 96, tiny_tokenizer(), engine="ray")
    with pytest.raises(ValueError, match=r"num_proc is the driver engine's"):
        raymoe.load_dataset(tmp_path / "a.jsonl", 96, tiny_tokenizer(), engine="ray", num_proc=2)


def test_a_ray_source_is_an_absolute_path_or_a_checked_url(tmp_path, monkeypatch):
    """Ray Data's read tasks run in other processes (other nodes): a relative path is made absolute on the driver,
    a file:// URL is its path, a hub id stays, an unknown scheme is one error before any read."""
    from raymoe.driver.ray_engine import ray_source

    (tmp_path / "a.jsonl").write_text("{}\n")
    monkeypatch.chdir(tmp_path)
    assert ray_source("a.jsonl") == str(tmp_path / "a.jsonl")
    assert ray_source(f"file://{tmp_path}/a.jsonl") == str(tmp_path / "a.jsonl")
    assert ray_source("org/name") == "org/name"
    with pytest.raises(ValueError, match=r"load_dataset path='nosuch://b/a\.jsonl'"):
        ray_source("nosuch://b/a.jsonl")


def test_jsonl_on_s3_gives_the_local_files_rows(ray_session, s3_bucket, tmp_path):
    """The Ray engine reads a URL where its read tasks run (the local S3 server here): the rows of the local file."""
    import fsspec

    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _chat(20)))
    url = f"{s3_bucket}/data/chat.jsonl"
    fsspec.filesystem("s3").put_file(str(path), url.removeprefix("s3://"))
    tokenizer = tiny_tokenizer()
    driver = raymoe.load_dataset(path, 96, tokenizer, cache_dir=False, pack_window=WINDOW)
    _same(driver, raymoe.load_dataset(url, 96, tokenizer, engine="ray", pack_window=WINDOW))
