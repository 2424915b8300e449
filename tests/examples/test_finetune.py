"""examples/finetune.py in this process on the session's local Ray: the embedded default learns, and bad input
ends the run with one error line before any training step."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
from ray.util.state import list_actors

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "finetune.py"


@pytest.fixture(scope="module")
def finetune():
    spec = importlib.util.spec_from_file_location("raymoe_example_finetune", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rank_actors_alive(ray) -> set:
    """Ids of the RankActors alive in the session's cluster (named explicitly: other Ray instances may run on this
    machine); the session's shared worlds are among them when a test started them."""
    address = ray.get_runtime_context().gcs_address
    alive = list_actors(address=address, filters=[("state", "=", "ALIVE")])
    return {a.actor_id for a in alive if a.class_name == "RankActor"}


@pytest.mark.slow
def test_embedded_default_loss_falls_and_artefacts_exist(ray_session, finetune, tmp_path, capsys):
    before = rank_actors_alive(ray_session)
    out = tmp_path / "run"
    assert finetune.main(["--steps", "16", "--eval-every", "8", "--output-dir", str(out), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "layout {'tp_size': 2, 'fsdp_size': 2, 'ep_size': 2}" in printed and "ep_size=2   E0-3   E4-7" in printed
    assert f"checkpoint  {out / 'checkpoint'}" in printed and f"plot  {out / 'metrics.png'}" in printed

    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r["eval_loss"] for r in records if "eval_loss" in r]
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in records if "eval_loss" in r] == [0, 8, 16]
    assert len(steps) == 16 and all(r["num_tokens"] == 8 * 127 for r in steps)  # 8 full rows of 128 per step
    assert evals[0] > 5.0 and evals[-1] < evals[0] - 1.5, evals  # from ~ln(264) down: it learns
    assert sum(r["loss"] for r in steps[-5:]) / 5 < steps[0]["loss"] - 1.5
    assert (out / "checkpoint" / "model.safetensors").is_file() and (out / "checkpoint" / "tokenizer.json").is_file()
    assert (out / "metrics.png").stat().st_size > 10_000
    # the embedded model trains with the per-layer aux loss: its part is in the loss, the telemetry in the records
    assert all(r["loss"] > r["lm_loss"] and r["aux_loss"] > 0 for r in steps)
    assert all(len(r["expert_load"]) == 2 and r["dropped_pairs"] == 0 for r in steps)
    assert rank_actors_alive(ray_session) == before


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gptoss_e4_k3_gqa2_window5"])
def test_a_tiny_hub_family_checkpoint_fine_tunes(
    ray_session, finetune, tiny_checkpoint, load_hf_model, tmp_path, family
):
    """``--model <dir>`` of a tiny gpt-oss written by transformers, on pre-tokenized data: loss falls,
    and the checkpoint it writes loads in transformers."""
    import numpy as np
    import torch

    tokens = np.tile(np.arange(3, 35, dtype=np.int64), 80)  # a repeating 32-token pattern: learnable in a few steps
    np.save(tmp_path / "tokens.npy", tokens)
    out = tmp_path / "run"
    argv = ["--model", str(tiny_checkpoint(family)), "--dataset", str(tmp_path / "tokens.npy"), "--seq-len", "16"]
    argv += ["--steps", "12", "--eval-every", "6", "--lr", "1e-2", "--output-dir", str(out), "--no-progress"]
    assert finetune.main(argv) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r["eval_loss"] for r in records if "eval_loss" in r]
    assert len(evals) == 3 and evals[-1] < evals[0] - 1.0, evals
    trained = load_hf_model(out / "checkpoint")
    ids = torch.as_tensor(tokens[:16])[None]
    with torch.no_grad():
        assert trained(input_ids=ids).logits.isfinite().all()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--dataset", "absent.txt"], r"dataset file 'absent.txt' does not exist"),
        (["--dataset", "{empty}"], r"dataset .*empty.txt is empty: it holds no text to train on"),
        (["--seq-len", "1024"], r"--seq-len=1024 exceeds the model's max_position_embeddings=512"),
        (["--steps", "0"], r"TrainerConfig: steps=0 must be an int >= 1"),
        (["--tp-size", "2", "--fsdp-size", "16"], r"needs 32 rank slots of 1 CPUs in groups of 2 per node"),
        (["--balance", "auxx"], r"balance='auxx': choose one of auto, aux, layer_aux, bias, none"),
        (["--capacity-factor", "-1"], r"capacity_factor=-1.0 must be a number > 0"),
        (["--router-aux-loss-coef", "-0.5"], r"router_aux_loss_coef=-0.5 must be a number >= 0"),
        (["--balance", "bias"], r"balance='bias' needs a router with a per-expert selection bias"),
        (["--seq-len", "100000000"], r"--seq-len=100000000 exceeds the model's max_position_embeddings=512"),
        (
            ["--dataset", "{out_of_vocab}"],
            r"out_of_vocab.npy must be token ids in \[0, 264\), got values in \[0, 999\]",
        ),
        (["--dataset", "{garbage}"], r"garbage.npy is not a .npy array of token ids"),
        (["--dataset", "{latin1}"], r"latin1.jsonl line 2 is not UTF-8 text"),
    ],
    ids=[
        "missing_dataset",
        "empty_dataset",
        "seq_len_too_long",
        "bad_steps",
        "does_not_fit_the_cluster",
        "unknown_balance",
        "negative_capacity",
        "negative_aux_coef",
        "bias_without_a_biased_router",
        "huge_seq_len_checked_before_reading",
        "npy_ids_outside_the_vocabulary",
        "npy_that_is_not_an_array",
        "jsonl_that_is_not_utf8",
    ],
)
def test_bad_input_is_one_error_before_any_step(ray_session, finetune, tmp_path, capsys, args, message):
    before = rank_actors_alive(ray_session)
    import numpy as np

    files = {name: tmp_path / name for name in ("empty.txt", "out_of_vocab.npy", "garbage.npy", "latin1.jsonl")}
    files["empty.txt"].write_text("")
    np.save(files["out_of_vocab.npy"], np.array([1, 2, 999, 3] * 50))
    files["garbage.npy"].write_bytes(b"not an array at all")
    files["latin1.jsonl"].write_bytes('{"text": "ok"}\n{"text": "caf\u00e9"}\n'.encode("latin-1"))
    out = tmp_path / "run"
    argv = []
    for arg in args:
        for name, file in files.items():
            arg = arg.replace("{" + name.split(".")[0] + "}", str(file))
        argv.append(arg)
    argv += ["--output-dir", str(out), "--no-progress"]
    assert finetune.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("finetune.py: error: "), err
    assert re.search(message, err[0]), err[0]
    assert not (out / "metrics.jsonl").exists()  # no step ran
    assert rank_actors_alive(ray_session) == before


@pytest.mark.parametrize("debug", [False, True])
def test_a_rank_failure_is_one_line_unless_debugging(finetune, monkeypatch, capsys, debug):
    from actors import RankError

    message = "rank 1 (dp_replicate=0, fsdp=1, tp=0) failed in train_step: RuntimeError: boom"
    remote = 'Traceback (most recent call last):\n  File "train.py", line 1\nRuntimeError: boom'

    def fail(args):
        raise RankError(f"{message}\n--- traceback on rank 1 ---\n{remote}", 1, "train_step", remote)

    monkeypatch.setattr(finetune, "run", fail)
    assert finetune.main(["--no-progress", *(["--debug"] if debug else [])]) == 1
    err = capsys.readouterr().err
    if debug:
        assert err.startswith(f"finetune.py: rank failure: {message}") and "RuntimeError: boom" in err.splitlines()[-1]
    else:
        assert err.strip().splitlines() == [
            f"finetune.py: rank failure: {message} (--debug shows the rank's traceback)"
        ]
