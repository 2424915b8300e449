"""TrainerConfig(report_to=...): TensorBoard, MLflow, wandb and trackio get every step, the config and the plot, read
back from each tool's own files with its own reader; a resumed or restarted run has each step once; a tracker that
fails mid-run is a warning and the run finishes; a missing library is an error naming its extra. All offline, on a
one-rank local world (``load_local``)."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

import raymoe
from raymoe import DistributedConfig, DistributedModel, PackedData, Trainer, TrainerConfig
from raymoe.driver.trackers import TRACKERS, TrackerNotInstalled
from raymoe.driver.trackers.tensorboard_run import TensorBoardRun
from raymoe.rank.local import LocalRankGroup
from raymoe.spec.launch import prepare_launch

BATCH, SEQ = 4, 16


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return raymoe.build_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def trackio_dir(tmp_path_factory):
    """trackio reads TRACKIO_DIR once, when it is first imported: set before that (each test has its own project)."""
    path = tmp_path_factory.mktemp("trackio")
    if "trackio" not in sys.modules:
        import os

        os.environ["TRACKIO_DIR"] = str(path)
    return path


@pytest.fixture
def offline(monkeypatch, tmp_path, trackio_dir):
    """Every tracker local: wandb offline, MLflow's sqlite store (artifacts under the working directory, tmp_path),
    a trackio project of this test's own."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")  # no console capture under pytest's
    monkeypatch.delenv("WANDB_DIR", raising=False)
    monkeypatch.setenv("WANDB_PROJECT", "raymoe-test")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "raymoe-test")
    monkeypatch.setenv("TRACKIO_PROJECT", f"raymoe-test-{uuid.uuid4().hex[:8]}")


def rows(num_rows: int = 16, seed: int = 3) -> PackedData:
    return PackedData.from_rows(torch.randint(0, 256, (num_rows, SEQ), generator=torch.Generator().manual_seed(seed)))


def config(out: Path, **kw) -> TrainerConfig:
    options = dict(steps=3, global_batch_size=BATCH, lr=1e-3, warmup_steps=1, save_at_end=False, progress=False,
                   report_to="all")  # fmt: skip
    return TrainerConfig(output_dir=out, **{**options, **kw})


def records(out: Path) -> dict[int, dict]:
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in lines if "loss" in r}


# --- each tool's own reader ----------------------------------------------------------------------------------------


def tensorboard_scalars(logging_dir: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(logging_dir), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    events.Reload()
    return events


def mlflow_run(out: Path):
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    run_id = json.loads((out / "trackers.json").read_text())["mlflow"]["run_id"]
    return client, client.get_run(run_id)


def wandb_history(out: Path) -> tuple[list[dict], dict]:
    """The history rows and config of every offline session of the run under ``out/wandb``, in order: the records of
    each ``run-*.wandb`` file (LevelDB-log framing, as wandb writes it) parsed as wandb's own ``Record`` messages."""
    from wandb.proto import wandb_internal_pb2

    history, run_config = [], {}
    for path in sorted((out / "wandb").glob("offline-run-*/run-*.wandb")):
        for data in leveldb_log_records(path.read_bytes()):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(data)
            kind = record.WhichOneof("record_type")
            if kind == "history":
                history.append(
                    {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
                )
            elif kind == "run":
                run_config.update({item.key: json.loads(item.value_json) for item in record.run.config.update})
    return history, run_config


def leveldb_log_records(data: bytes, block: int = 32768):
    ident, magic, _ = struct.unpack("<4sHB", data[:7])
    assert ident == b":W&B" and magic == 0xBEE1
    position, parts = 7, b""
    while position + 7 <= len(data):
        if block - position % block < 7:  # a block's tail too short for a header is padding
            position += block - position % block
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        if length == 0 and kind == 0:
            position += block - position % block
            continue
        parts += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # FULL or LAST
            yield parts
            parts = b""


def trackio_logs(out: Path) -> list[dict]:
    import os

    from trackio.sqlite_storage import SQLiteStorage

    name = json.loads((out / "trackers.json").read_text())["trackio"]["run_id"]
    return SQLiteStorage.get_logs(os.environ["TRACKIO_PROJECT"], name)


def steps_logged(out: Path, key: str = "loss") -> dict[str, list[int]]:
    """The steps each tool holds ``key`` at, as its own reader gives them back (repeats kept)."""
    client, run = mlflow_run(out)
    history, _ = wandb_history(out)
    return {
        "tensorboard": [e.step for e in tensorboard_scalars(out / "runs").Scalars(key)],
        "mlflow": [m.step for m in client.get_metric_history(run.info.run_id, key)],
        "wandb": [row["_step"] for row in history if key in row],
        "trackio": [row["step"] for row in trackio_logs(out) if key in row],
    }


# --- the tests -----------------------------------------------------------------------------------------------------


def test_every_tracker_gets_the_steps_the_config_and_the_plot(load_local, tiny, tmp_path, offline):
    out = tmp_path / "run"
    with load_local(tiny) as model:
        assert config(out).trackers == TRACKERS  # "all": every one installed (the test extra installs all four)
        summary = Trainer(model, rows(), config(out, eval_every=2), eval_data=rows(4, seed=5)).fit()
    assert summary.steps == 3
    steps = records(out)
    eval_steps = [0, 2, 3]

    events = tensorboard_scalars(out / "runs")
    for key in ("loss", "lm_loss", "aux_loss", "lr", "grad_norm", "tokens_per_s", "num_tokens"):
        assert [(e.step, pytest.approx(e.value, rel=1e-6)) for e in events.Scalars(key)] == [
            (s, steps[s][key]) for s in (1, 2, 3)
        ], key
    assert [e.step for e in events.Scalars("eval_loss")] == eval_steps
    assert {"routing/expert_imbalance/layer_0", "routing/expert_imbalance/layer_1"} <= set(events.Tags()["scalars"])
    assert {"routing/dead_experts/layer_1", "routing/max_expert_imbalance"} <= set(events.Tags()["scalars"])
    assert events.Scalars("routing/max_expert_imbalance")[0].value == pytest.approx(steps[1]["max_expert_imbalance"])
    (image,) = events.Images("plot")
    assert image.step == 3 and image.width == 1600 and image.encoded_image_string[:4] == b"\x89PNG"
    assert {"config/params", "config/describe", "config/plans"} <= {
        t.split("/text_summary")[0] for t in events.Tags()["tensors"]
    }

    client, run = mlflow_run(out)
    history = client.get_metric_history(run.info.run_id, "loss")
    assert [(m.step, m.value) for m in history] == [(s, pytest.approx(steps[s]["loss"])) for s in (1, 2, 3)]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "eval_loss")] == eval_steps
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    assert run.data.params["trainer/lr"] == "0.001" and run.data.params["layout/world_size"] == "1"
    assert run.data.params["trainer/report_to"] == str(list(TRACKERS))
    assert {"metrics.png", "describe.txt", "plans.txt"} <= {a.path for a in client.list_artifacts(run.info.run_id)}
    assert "routing/dead_experts/layer_0" in run.data.metrics

    rows_, run_config = wandb_history(out)
    assert [r["_step"] for r in rows_ if "loss" in r] == [1, 2, 3]
    assert [r["_step"] for r in rows_ if "eval_loss" in r] == eval_steps
    assert [r["loss"] for r in rows_ if "loss" in r] == pytest.approx([steps[s]["loss"] for s in (1, 2, 3)])
    assert run_config["trainer/steps"] == 3 and "rank" in run_config["describe"]
    (plot,) = [r for r in rows_ if "plot/path" in r]
    assert plot["_step"] == 3 and plot["plot/format"] == "png"
    assert (next((out / "wandb").glob("offline-run-*")) / "files" / plot["plot/path"]).is_file()

    logs = trackio_logs(out)
    assert [r["step"] for r in logs if "loss" in r] == [1, 2, 3]
    assert [r["loss"] for r in logs if "loss" in r] == pytest.approx([steps[s]["loss"] for s in (1, 2, 3)])
    assert [r["step"] for r in logs if "eval_loss" in r] == eval_steps
    (plot,) = [r for r in logs if "plot" in r]
    assert plot["step"] == 3 and plot["plot"]["_type"] == "trackio.image"


def owned_local_model(checkpoint) -> DistributedModel:
    """A model that owns its local world (restart() starts a new one), as from_pretrained owns its Ray ranks."""
    return DistributedModel.launch(prepare_launch(checkpoint, DistributedConfig()), LocalRankGroup(), owns_group=True)


def test_a_resumed_and_a_restarted_run_have_each_step_once(tiny, tmp_path, offline, fail_at_forward):
    """Steps 1-3 logged with a state after 2; the resumed run makes step 3 again and step 4; then a failure in step 6
    restarts from the state of step 4 and makes steps 5 and 6 again. Each tool holds each step once, in one run."""
    out = tmp_path / "run"
    with owned_local_model(tiny) as model:
        Trainer(model, rows(), config(out, steps=6, save_state_every=2)).fit(num_steps=3)
        first = json.loads((out / "trackers.json").read_text())
        assert {name: entry["logged_through"] for name, entry in first.items()} == dict.fromkeys(TRACKERS, 3)
    with owned_local_model(tiny) as model:
        trainer = Trainer(model, rows(), config(out, steps=6, save_state_every=2, max_failures=1, resume_from="latest"))
        assert trainer.step == 2
        model.run_on_ranks(fail_at_forward, 4)  # in step 6: steps 3, 4, 5 pass
        summary = trainer.fit()
    assert summary.restarts == 1 and summary.resumed_from.name == "step-00000002"
    assert {name: entry["run_id"] for name, entry in json.loads((out / "trackers.json").read_text()).items()} == {
        name: entry["run_id"] for name, entry in first.items()
    }  # the same runs, reopened
    for tool, steps in steps_logged(out).items():
        assert steps == [1, 2, 3, 4, 5, 6], tool
    # TensorBoard shows the values of the run that made a step last; the others keep the first (the same here: the
    # resumed and restarted runs recompute the uninterrupted one).
    final = records(out)
    events = tensorboard_scalars(out / "runs")
    assert [e.value for e in events.Scalars("loss")] == pytest.approx([final[s]["loss"] for s in range(1, 7)], rel=1e-5)
    client, run = mlflow_run(out)
    assert [m.value for m in client.get_metric_history(run.info.run_id, "loss")] == pytest.approx(
        [final[s]["loss"] for s in range(1, 7)], rel=1e-5
    )
    assert len(client.search_runs([run.info.experiment_id])) == 1 and run.info.status == "FINISHED"


def test_a_tracker_that_fails_mid_run_is_dropped_with_a_warning(load_local, tiny, tmp_path, offline, monkeypatch):
    calls = []
    log_scalars = TensorBoardRun.log_scalars

    def flaky(self, step, values):
        calls.append(step)
        if step == 2:
            raise OSError("disk full")
        log_scalars(self, step, values)

    monkeypatch.setattr(TensorBoardRun, "log_scalars", flaky)
    out = tmp_path / "run"
    with load_local(tiny) as model:
        trainer = Trainer(model, rows(), config(out, report_to=["tensorboard", "mlflow"]))
        with pytest.warns(RuntimeWarning, match=r"report_to: tensorboard failed logging step 2 \(OSError: disk full\)"):
            summary = trainer.fit()
    assert summary.steps == 3 and sorted(records(out)) == [1, 2, 3]
    assert calls == [1, 2]  # dropped: not called again
    assert [e.step for e in tensorboard_scalars(out / "runs").Scalars("loss")] == [1]
    client, run = mlflow_run(out)
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [1, 2, 3]  # the others go on


def test_a_missing_library_is_an_error_naming_its_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)  # as if not installed
    with pytest.raises(TrackerNotInstalled, match=r"report_to names 'mlflow'.*pip install 'raymoe\[mlflow\]'"):
        TrainerConfig(output_dir=tmp_path, report_to=["tensorboard", "mlflow"])
    with pytest.raises(ValueError, match=r"pip install 'raymoe\[mlflow\]'"):  # a ValueError too: one line in scripts
        TrainerConfig(output_dir=tmp_path, report_to="mlflow")
    assert "mlflow" not in TrainerConfig(output_dir=tmp_path, report_to="all").trackers


def test_a_tracker_that_cannot_start_is_an_error_before_any_step(load_local, tiny, tmp_path, offline, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "unknown-scheme://nowhere")
    out = tmp_path / "run"
    with load_local(tiny) as model:
        trainer = Trainer(model, rows(), config(out, report_to=["tensorboard", "mlflow"]))
        with pytest.raises(RuntimeError, match=r"report_to: mlflow could not start its run"):
            trainer.fit()
        assert trainer.step == 0 and records(out) == {}


def test_importing_raymoe_imports_no_tracker():
    code = (
        "import sys, raymoe; from raymoe import Trainer, TrainerConfig; import raymoe.driver.trackers; "
        "print(sorted(m for m in ('tensorboard', 'torch.utils.tensorboard', 'mlflow', 'wandb', 'trackio') "
        "if m in sys.modules))"
    )
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "[]\n"
