"""Paths a user gives for what raymoe writes: ``file://`` URLs are their path, other URLs one clear error on the
driver (before, ``output_dir="s3://bucket/run"`` wrote a local folder named ``s3:``)."""

from pathlib import Path

import pytest
import torch

import raymoe
from raymoe.driver.local_paths import local_path


def test_paths_and_file_urls_become_absolute_local_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert local_path("runs/a", "output_dir") == tmp_path / "runs" / "a"
    assert local_path(Path("~/x"), "output_dir") == Path.home() / "x"
    assert local_path("file:///data/my%20run", "output_dir") == Path("/data/my run")
    assert local_path("file://localhost/data/run", "output_dir") == Path("/data/run")


@pytest.mark.parametrize("url", ["s3://bucket/run", "gs://b/r", "hf://datasets/x", "abfs://c/r", "file://host/data"])
def test_other_urls_are_one_error_naming_the_field(url):
    with pytest.raises(ValueError, match=r"^output_dir='.*'"):
        local_path(url, "output_dir")


def test_trainer_config_checks_urls_and_takes_a_file_url(tmp_path):
    with pytest.raises(ValueError, match=r"TrainerConfig: output_dir='nosuch://bucket/run': nosuch:// is not a"):
        raymoe.TrainerConfig(output_dir="nosuch://bucket/run")
    with pytest.raises(ValueError, match=r"TrainerConfig: logging_dir='gs://b/tb' is a gs:// URL; logging_dir takes"):
        raymoe.TrainerConfig(output_dir=tmp_path, logging_dir="gs://b/tb")
    with pytest.raises(ValueError, match=r"TrainerConfig: resume_from='nosuch://b/run/states/step-00000002'"):
        raymoe.TrainerConfig(output_dir=tmp_path, resume_from="nosuch://b/run/states/step-00000002")
    with pytest.raises(ValueError, match=r"output_dir=None must be a directory path"):
        raymoe.TrainerConfig(output_dir=None)
    config = raymoe.TrainerConfig(output_dir=f"file://{tmp_path}/run")
    assert config.run_directory().root == tmp_path / "run"
    assert not (Path.cwd() / "file:").exists()


def test_saves_refuse_a_bad_url_before_any_rank_writes(load_local, tiny_checkpoint, tmp_path):
    model = load_local(tiny_checkpoint("moe_e8_k2_mha"))
    model.configure_training(lr=1e-3)
    model.train_step(torch.randint(0, 64, (2, 8)))
    for save, field in ((model.save_pretrained, "save_pretrained path"), (model.save_state, "save_state path")):
        with pytest.raises(ValueError, match=rf"{field}='nosuch://bucket/x': nosuch:// is not a filesystem fsspec"):
            save("nosuch://bucket/x")
    assert model.save_pretrained(f"file://{tmp_path}/ckpt") is not None
    assert (tmp_path / "ckpt" / "config.json").is_file()
    assert not (Path.cwd() / "nosuch:").exists()


def test_a_local_only_field_says_which_fields_take_urls():
    with pytest.raises(ValueError, match=r"output_dir takes a local path only for now \(storage URLs are taken by "):
        local_path("s3://bucket/run", "output_dir")


def test_a_path_flag_is_one_usage_error_for_a_url(tmp_path):
    import argparse

    from raymoe.driver.local_paths import path_flag

    parse = path_flag("--output-dir")
    assert parse(f"file://{tmp_path}/run") == tmp_path / "run"
    with pytest.raises(argparse.ArgumentTypeError, match=r"^--output-dir='s3://b/r' is a s3:// URL"):
        parse("s3://b/r")


def test_export_refuses_an_unknown_url_and_from_pretrained_takes_a_file_url(tiny_checkpoint, capsys):
    from raymoe.checkpoint.hub import resolve_checkpoint
    from raymoe.cli import main

    directory = tiny_checkpoint("moe_e8_k2_mha")
    assert resolve_checkpoint(f"file://{directory}") == directory
    with pytest.raises(SystemExit):
        main(["export", "nosuch://b/state", "/tmp/x"])
    assert "STATE_DIR='nosuch://b/state'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["export", "/tmp/state", "hf://org/model"])
    assert "OUT_DIR='hf://org/model'" in capsys.readouterr().err


def test_a_url_cache_dir_is_one_error(tiny_checkpoint):
    with pytest.raises(ValueError, match=r"cache_dir='s3://b/cache' must be a local directory path, not a URL"):
        raymoe.from_pretrained(tiny_checkpoint("moe_e8_k2_mha"), cache_dir="s3://b/cache")
