"""save_pretrained, save_state and load_state through storage URLs: a local S3-compatible server (moto, via s3fs) and
``file://``, on a LocalRankGroup (one rank in this process); a two-rank Ray world across layouts is in
tests/actors/test_storage_urls.py."""

from __future__ import annotations

import json
from pathlib import Path

import fsspec
import pytest
import torch

from raymoe.checkpoint.committed import COMMIT_FILE, committed, generations, new_generation
from raymoe.checkpoint.staging import CheckpointSaveError
from raymoe.checkpoint.storage import StorageUrl
from raymoe.checkpoint.training_state import TrainingStateError

CHECKPOINT = "moe_e8_k2_mha"


def _trained(load_local, tiny_checkpoint, steps: int):
    model = load_local(tiny_checkpoint(CHECKPOINT))
    model.configure_training(lr=1e-2)
    generator = torch.Generator().manual_seed(0)
    for _ in range(steps):
        model.train_step(torch.randint(0, 64, (2, 8), generator=generator))
    return model


PROBE = torch.arange(16).reshape(2, 8) % 64


@pytest.mark.parametrize("scheme", ["s3", "file"])
def test_a_state_round_trips_through_a_url(scheme, load_local, tiny_checkpoint, tmp_path, request):
    root = request.getfixturevalue("s3_bucket") if scheme == "s3" else f"file://{tmp_path}"
    url = f"{root}/run/state"
    model = _trained(load_local, tiny_checkpoint, steps=2)
    saved_logits = model(PROBE)
    target = model.save_state(url, extra={"epoch": 3})
    assert str(target) == (url if scheme == "s3" else str(tmp_path / "run" / "state"))
    model.train_step(torch.randint(0, 64, (2, 8)))
    assert not torch.allclose(model(PROBE), saved_logits)
    manifest = model.load_state(url)
    assert manifest.step == 2 and manifest.extra == {"epoch": 3} and model.step == 2
    torch.testing.assert_close(model(PROBE), saved_logits, rtol=0, atol=0)
    model.shutdown()
    fresh = load_local(tiny_checkpoint(CHECKPOINT))
    assert fresh.check_state(url).manifest.step == 2
    fresh.load_state(url)
    torch.testing.assert_close(fresh(PROBE), saved_logits, rtol=0, atol=0)
    fresh.train_step(torch.randint(0, 64, (2, 8)))  # the restored AdamW steps on
    assert fresh.step == 3


def test_a_save_interrupted_before_its_marker_leaves_the_previous_state(
    load_local, tiny_checkpoint, s3_bucket, monkeypatch, caplog
):
    url = f"{s3_bucket}/state"
    target = StorageUrl("s3", url.removeprefix("s3://"))
    fs = fsspec.filesystem("s3")
    model = _trained(load_local, tiny_checkpoint, steps=1)
    step1_logits = model(PROBE)
    model.save_state(url)
    first = committed(target)
    model.train_step(torch.randint(0, 64, (2, 8)))

    def killed_before_the_marker(target, generation):
        raise ConnectionError("the node went away before the commit marker")

    monkeypatch.setattr("raymoe.rank.state.commit", killed_before_the_marker)
    with pytest.raises(CheckpointSaveError, match=r"saved nothing: .*ConnectionError.*before the commit marker"):
        model.save_state(url)
    monkeypatch.undo()
    assert committed(target) == first and generations(target) == [first]  # the failed one removed, the old one kept
    stray = new_generation(target)  # what a save killed mid-write leaves: data, no manifest, no marker
    fs.pipe_file(stray.join("__0_0.distcp").path, b"partial")
    assert model.load_state(url).step == 1
    torch.testing.assert_close(model(PROBE), step1_logits, rtol=0, atol=0)
    model.train_step(torch.randint(0, 64, (2, 8)))
    with caplog.at_level("WARNING"):
        model.save_state(url)
    assert f"removed {stray}, left by a save into {target} that did not commit" in caplog.text
    assert generations(target) == [committed(target)] and committed(target) not in (first, stray)
    assert model.check_state(url).manifest.step == 2


def test_a_url_without_a_committed_state_is_a_clear_error(load_local, tiny_checkpoint, s3_bucket):
    model = _trained(load_local, tiny_checkpoint, steps=1)
    fs = fsspec.filesystem("s3")
    fs.pipe_file(f"{s3_bucket.removeprefix('s3://')}/half/g-1/__0_0.distcp", b"x")
    with pytest.raises(TrainingStateError, match=r"s3://.*/half holds no committed raymoe training state"):
        model.load_state(f"{s3_bucket}/half")
    with pytest.raises(ValueError, match=r"state path='s3://.*/absent': it does not exist"):
        model.load_state(f"{s3_bucket}/absent")
    assert not any(COMMIT_FILE in str(p) for p in fs.find(s3_bucket.removeprefix("s3://")))


def test_save_pretrained_uploads_the_hub_checkpoint(load_local, tiny_checkpoint, s3_bucket, tmp_path):
    model = _trained(load_local, tiny_checkpoint, steps=1)
    url = f"{s3_bucket}/ckpt"
    fs = fsspec.filesystem("s3")
    local = tmp_path / "local"
    model.save_pretrained(local, max_shard_size=20_000)
    files = model.save_pretrained(url, max_shard_size=20_000)
    shards = sorted(path.name for path in local.glob("*.safetensors"))
    assert len(shards) > 1 and sorted(f.rsplit("/", 1)[-1] for f in files) == shards
    downloaded = tmp_path / "downloaded"
    fs.get(url.removeprefix("s3://") + "/", str(downloaded), recursive=True)
    assert sorted(p.name for p in downloaded.iterdir()) == sorted(p.name for p in local.iterdir())
    for path in local.iterdir():
        assert (downloaded / path.name).read_bytes() == path.read_bytes(), path.name
    logits = model(PROBE)
    model.save_pretrained(url)  # one shard now: the old shards and the index go
    fs.invalidate_cache()
    names = sorted(Path(p).name for p in fs.ls(url.removeprefix("s3://"), detail=False))
    assert names == ["config.json", "model.safetensors"]
    model.shutdown()
    again = tmp_path / "again"
    fs.get(url.removeprefix("s3://") + "/", str(again), recursive=True)
    reloaded = load_local(again)
    torch.testing.assert_close(reloaded(PROBE), logits)


def test_a_state_saved_by_two_ranks_on_s3_loads_on_another_layout(load_on_world, tiny_checkpoint, s3_bucket):
    """Every rank writes its own shards to the bucket (DCP's fsspec writer), rank 0 commits; another layout reads."""
    url = f"{s3_bucket}/state"
    generator = torch.Generator().manual_seed(0)
    with load_on_world(tiny_checkpoint(CHECKPOINT), {"fsdp_size": 2, "ep_size": 2}) as model:
        model.configure_training(lr=1e-2)
        for _ in range(2):
            model.train_step(torch.randint(0, 64, (2, 8), generator=generator))
        saved_logits = model(PROBE)
        model.save_state(url, async_save=True)
        assert str(model.wait_for_save()) == url
    data_files = [p for p in fsspec.filesystem("s3").find(url.removeprefix("s3://")) if p.endswith(".distcp")]
    assert len(data_files) == 2  # one per rank
    with load_on_world(tiny_checkpoint(CHECKPOINT), {"tp_size": 2}) as model:
        assert model.load_state(url).step == 2
        torch.testing.assert_close(model(PROBE), saved_logits, rtol=1e-5, atol=1e-5)


def test_a_trainer_runs_and_resumes_on_an_s3_output_dir(load_local, s3_bucket, tmp_path):
    """Metrics, states (keep_last), the checkpoint and the tokenizer on the bucket; a resumed run continues there,
    each step once in its metrics, as a local run's (same losses)."""
    import json

    import raymoe
    from raymoe import PackedData, Trainer, TrainerConfig

    tiny = raymoe.build_tiny_checkpoint(tmp_path / "tiny")
    data = PackedData.from_rows(torch.randint(0, 256, (16, 16), generator=torch.Generator().manual_seed(3)))
    options = dict(global_batch_size=4, lr=1e-3, warmup_steps=1, save_state_every=2, keep_last=1, progress=False)
    url, fs = f"{s3_bucket}/run", fsspec.filesystem("s3")

    def metrics(where: str) -> list[dict]:
        return [json.loads(line) for line in fs.cat_file(f"{where}/metrics.jsonl").decode().splitlines()]

    with load_local(tiny) as model:
        summary = Trainer(model, data, TrainerConfig(output_dir=url, steps=6, **options)).fit(4)  # then stopped
    assert summary.checkpoint == StorageUrl("s3", f"{url.removeprefix('s3://')}/checkpoint")
    root = url.removeprefix("s3://")
    assert [r["step"] for r in metrics(root) if "loss" in r] == [1, 2, 3, 4]
    assert fs.exists(f"{root}/metrics.png") and fs.exists(f"{root}/checkpoint/model.safetensors")
    fs.invalidate_cache()
    assert sorted(Path(p).name for p in fs.ls(f"{root}/states", detail=False)) == ["step-00000004"]  # keep_last=1
    with load_local(tiny) as model:
        resumed = Trainer(model, data, TrainerConfig(output_dir=url, steps=6, resume_from="latest", **options))
        assert resumed.step == 4
        resumed.fit()
    steps = [r for r in metrics(root) if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]
    with load_local(tiny) as model:  # the same run on a local output_dir: the same losses
        Trainer(model, data, TrainerConfig(output_dir=tmp_path / "local", steps=6, **options)).fit()
    local = [json.loads(line) for line in (tmp_path / "local" / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in steps] == pytest.approx([r["loss"] for r in local if "loss" in r], rel=1e-5)
    with pytest.raises(ValueError, match=rf"output_dir {url} holds an earlier run \(a non-empty metrics.jsonl, a "):
        TrainerConfig(output_dir=url, steps=6, **options).check_output_dir()


def test_from_pretrained_reads_a_checkpoint_at_a_url_through_a_node_cache(
    load_local, tiny_checkpoint, s3_bucket, tmp_path
):
    """The driver fetches config.json, the rank what it reads; the cache follows the URL when it is saved anew."""
    from raymoe.checkpoint.download import FETCHED_FILE

    source = tiny_checkpoint(CHECKPOINT)
    fs, url, cache = fsspec.filesystem("s3"), f"{s3_bucket}/model", tmp_path / "cache"
    fs.put(str(source) + "/", url.removeprefix("s3://"), recursive=True)
    with load_local(source) as local:
        expected = local(PROBE)
    with load_local(url, cache_dir=cache) as model:
        torch.testing.assert_close(model(PROBE), expected, rtol=0, atol=0)
        model.configure_training(lr=1e-2)
        model.train_step(torch.randint(0, 64, (2, 8)))
        trained = model(PROBE)
        model.save_pretrained(url, max_shard_size=20_000)  # saved anew at the same URL, in several shards
    copy = cache / "raymoe-storage" / "s3" / url.removeprefix("s3://")
    assert (copy / FETCHED_FILE).is_file() and not any(copy.glob("*.partial"))
    with load_local(url, cache_dir=cache) as model:  # the stale copy refreshed: the new weights
        torch.testing.assert_close(model(PROBE), trained)
    assert sorted(p.name for p in copy.glob("*.safetensors")) == sorted(
        Path(p).name for p in fs.ls(url.removeprefix("s3://"), detail=False) if p.endswith(".safetensors")
    )
    with pytest.raises(ValueError, match=r"checkpoint s3://.*/nothing: cannot list it|holds none of"):
        load_local(f"{s3_bucket}/nothing", cache_dir=cache)


def test_two_ranks_on_one_node_fetch_a_url_checkpoint_once(load_on_world, tiny_checkpoint, s3_bucket, tmp_path):
    from raymoe.checkpoint.download import FETCHED_FILE

    source, url, cache = tiny_checkpoint(CHECKPOINT), f"{s3_bucket}/model", tmp_path / "cache"
    fsspec.filesystem("s3").put(str(source) + "/", url.removeprefix("s3://"), recursive=True)
    with load_on_world(source, {"fsdp_size": 2}) as model:
        expected = model(PROBE)
    with load_on_world(url, {"fsdp_size": 2}, cache_dir=cache) as model:
        torch.testing.assert_close(model(PROBE), expected, rtol=0, atol=0)
    copy = cache / "raymoe-storage" / "s3" / url.removeprefix("s3://")
    assert "model.safetensors" in json.loads((copy / FETCHED_FILE).read_text())


def test_raymoe_export_reads_a_state_and_writes_a_checkpoint_at_urls(load_local, tiny_checkpoint, s3_bucket, tmp_path):
    """``raymoe export s3://.../state s3://.../hub``: the state read where its marker points, the checkpoint uploaded;
    the same files as a local export of a local copy of that state; exporting into the state itself is refused."""
    from raymoe.checkpoint.export import export_state
    from raymoe.cli import main

    url = f"{s3_bucket}/run/state"
    with _trained(load_local, tiny_checkpoint, steps=2) as model:
        model.save_state(url)
        model.save_state(tmp_path / "state")
    assert main(["export", url, f"{s3_bucket}/hub"]) == 0
    export_state(tmp_path / "state", tmp_path / "hub")
    fs = fsspec.filesystem("s3")
    uploaded = {Path(p).name: fs.cat(p) for p in fs.find(f"{s3_bucket.removeprefix('s3://')}/hub")}
    local = {p.name: p.read_bytes() for p in (tmp_path / "hub").iterdir() if p.is_file()}
    assert uploaded.keys() == local.keys() and "config.json" in uploaded
    assert all(uploaded[name] == local[name] for name in local if name.endswith(".safetensors"))
    assert main(["export", url, url]) == 2


def test_a_url_output_dir_is_probed_once_and_publish_uploads_what_changed(s3_bucket, monkeypatch):
    """TrainerConfig resolves (and probes) a URL output_dir once, its run directories reuse it; publish uploads the
    mirror's files that changed since the last publish, and nothing when none did."""
    from raymoe import TrainerConfig
    from raymoe.driver import local_paths, run_directory

    probes, uploads = [], []
    probe = local_paths.check_reachable
    monkeypatch.setattr(local_paths, "check_reachable", lambda *a, **k: (probes.append(a[0]), probe(*a, **k))[1])
    upload = run_directory.upload_directory
    monkeypatch.setattr(
        run_directory,
        "upload_directory",
        lambda *a, **k: (uploads.append(sorted(p.name for p in k["only"])), upload(*a, **k))[1],
    )
    config = TrainerConfig(output_dir=f"{s3_bucket}/run", steps=2)
    run = config.run_directory()
    assert config.check_output_dir() is None
    assert len(probes) == 1
    run.open_mirror(resumed=False)
    run.metrics.write_text('{"step": 1}\n')
    (run.root / "tb").mkdir()
    (run.root / "tb" / "events").write_bytes(b"x" * 10)
    run.publish()
    run.publish()  # nothing changed
    run.metrics.write_text('{"step": 1}\n{"step": 2}\n')
    run.publish()
    assert uploads == [["events", "metrics.jsonl"], ["metrics.jsonl"]]
    fs = fsspec.filesystem("s3")
    assert fs.cat(f"{s3_bucket.removeprefix('s3://')}/run/metrics.jsonl").count(b"step") == 2
