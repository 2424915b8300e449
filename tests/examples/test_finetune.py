"""examples/finetune.py in this process on the session's local Ray: the embedded default learns, and bad input
ends the run with one error line before any training step.

The runs about data, flags and models load onto the session's shared worlds (``main(argv, world)``: a world start
is ~6 s of 4 rank processes importing torch on 2 cores); the embedded default's run and Ctrl-C's start and free
ranks of their own, as the command line does."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from raymoe import build_tiny_checkpoint

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "finetune.py"


@pytest.fixture(scope="module")
def finetune():
    spec = importlib.util.spec_from_file_location("raymoe_example_finetune", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_embedded_default_loss_falls_and_artefacts_exist(ray_session, ray_tables, world, finetune, tmp_path, capsys):
    """The run ``python examples/finetune.py`` makes, on the session's world of 4 (starting and freeing a world of its
    own is the subject of the SIGINT test below and of tests/examples/test_job_submit.py)."""
    ranks = world(4)
    before = ray_tables.rank_actors()
    out = tmp_path / "run"
    argv = ["--steps", "16", "--eval-every", "8", "--output-dir", str(out), "--no-progress"]
    assert finetune.main(argv, ranks) == 0
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
    assert ray_tables.rank_actors() == before  # the world's ranks live on, and nothing else does


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gptoss_e4_k3_gqa2_window5"])
def test_a_tiny_hub_family_checkpoint_fine_tunes(
    ray_session, world, finetune, tiny_checkpoint, load_hf_model, tmp_path, family
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
    assert finetune.main(argv, world(4)) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r["eval_loss"] for r in records if "eval_loss" in r]
    assert len(evals) == 3 and evals[-1] < evals[0] - 1.0, evals
    trained = load_hf_model(out / "checkpoint")
    ids = torch.as_tensor(tokens[:16])[None]
    with torch.no_grad():
        assert trained(input_ids=ids).logits.isfinite().all()


@pytest.mark.slow
def test_long_sequence_flags_split_every_row_and_train(ray_session, world, finetune, tmp_path, capsys):
    """``--cp-size 2 --cp-mode all_to_all --sequence-parallel`` on the embedded default (tp2, ep2): every row split
    over two cp ranks, the residual stream over the tp pair; the eval loss falls."""
    out = tmp_path / "run"
    layout = ["--cp-size", "2", "--cp-mode", "all_to_all", "--sequence-parallel", "--fsdp-size", "1"]
    argv = [*layout, "--steps", "8", "--eval-every", "4", "--output-dir", str(out), "--no-progress"]
    assert finetune.main(argv, world(4)) == 0
    printed = capsys.readouterr().out
    assert "'cp_size': 2, 'cp_mode': 'all_to_all', 'enable_sequence_parallel': True" in printed
    assert "chunks      c0c3" in printed  # model.describe() draws the cp axis
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r["eval_loss"] for r in records if "eval_loss" in r]
    assert len(evals) == 3 and evals[-1] < evals[0], evals


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
        (["--cp-size", "4", "--seq-len", "100"], r"a sequence of 100 tokens does not split over cp_size=4"),
        (["--sequence-parallel", "--tp-size", "1"], r"enable_sequence_parallel=True .* tp_size=1; .*\[CFG-9\]"),
        (
            ["--dataset", "{out_of_vocab}"],
            r"out_of_vocab.npy must be token ids in \[0, 264\), got values in \[0, 999\]",
        ),
        (["--dataset", "{garbage}"], r"garbage.npy is not a .npy array of token ids"),
        (["--dataset", "{latin1}"], r"latin1.jsonl line 2 is not UTF-8 text"),
        (["--dataset", "{no_answer}"], r"no_answer.jsonl line 2: the conversation has no assistant turn"),
        (["--dataset", "{bad_role}"], r"bad_role.jsonl line 1 message 1 has an unknown role 'bot'"),
        (
            ["--dataset", "{long_chat}", "--seq-len", "32"],
            r"long_chat.jsonl line 1 is 46 tokens long, more than seq_len=32 .* --overlong truncate",
        ),
        (
            ["--dataset", "{no_answer}", "--model", "{no_template}"],
            r"no_answer.jsonl holds conversations, but the checkpoint has no chat template .* --chat-template",
        ),
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
        "seq_len_that_cp_cannot_split",
        "sequence_parallel_without_tp",
        "npy_ids_outside_the_vocabulary",
        "npy_that_is_not_an_array",
        "jsonl_that_is_not_utf8",
        "chat_without_an_assistant_turn",
        "chat_with_an_unknown_role",
        "chat_longer_than_seq_len",
        "chat_without_a_chat_template",
    ],
)
def test_bad_input_is_one_error_before_any_step(ray_session, ray_tables, finetune, tmp_path, capsys, args, message):
    before = ray_tables.rank_actors()
    import numpy as np

    files = {name: tmp_path / name for name in ("empty.txt", "out_of_vocab.npy", "garbage.npy", "latin1.jsonl")}
    files["empty.txt"].write_text("")
    np.save(files["out_of_vocab.npy"], np.array([1, 2, 999, 3] * 50))
    files["garbage.npy"].write_bytes(b"not an array at all")
    files["latin1.jsonl"].write_bytes('{"text": "ok"}\n{"text": "caf\u00e9"}\n'.encode("latin-1"))
    turn = {"role": "user", "content": "hi"}
    answer = {"role": "assistant", "content": "hello"}
    chats = {"no_answer.jsonl": [[turn, answer], [turn]], "bad_role.jsonl": [[turn, {"role": "bot", "content": "x"}]]}
    chats["long_chat.jsonl"] = [[{"role": "user", "content": "x" * 20}, answer]]
    for name, conversations in chats.items():
        files[name] = tmp_path / name
        files[name].write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations))
    files["no_template"] = tmp_path / "no_template"  # the embedded model without its chat template
    build_tiny_checkpoint(files["no_template"])
    (files["no_template"] / "tokenizer_config.json").unlink()
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
    assert ray_tables.rank_actors() == before


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["driver", "ray"])
def test_chat_data_trains_on_the_assistant_answers_only(ray_session, world, finetune, tmp_path, capsys, engine):
    """--dataset chat.jsonl on the embedded model: the label tokens of a step over every row are exactly the
    assistant answers' bytes and one <|im_end|> each, counted by hand over the file (byte-level tokenizer); also
    with --data-engine ray, whose rows stay in Ray's object store."""
    import raymoe

    lines = (SCRIPT.parent / "data" / "chat.jsonl").read_text().splitlines()[:24]
    chat = tmp_path / "chat.jsonl"
    chat.write_text("\n".join(lines) + "\n")
    answers = [m["content"] for line in lines for m in json.loads(line)["messages"] if m["role"] == "assistant"]
    hand_count = sum(len(answer.encode("utf-8")) + 1 for answer in answers)  # + <|im_end|>
    rows = raymoe.load_dataset(
        chat, 128, raymoe.load_tokenizer(raymoe.build_tiny_checkpoint(tmp_path / "m"))
    ).num_sequences
    out = tmp_path / "run"
    argv = ["--dataset", str(chat), "--eval-fraction", "0", "--global-batch-size", str(rows), "--steps", "2"]
    argv += ["--data-engine", engine, *(["--no-cache"] if engine == "ray" else [])]
    assert finetune.main([*argv, "--output-dir", str(out), "--no-progress"], world(4)) == 0
    printed = capsys.readouterr().out
    assert f"data: 24 conversations -> {rows} rows of 128 tokens; document packing" in printed
    assert f"{hand_count} label tokens" in printed
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["num_tokens"] for r in steps] == [hand_count, hand_count]  # each step holds every row once
    assert steps[1]["loss"] < steps[0]["loss"]
    saved = raymoe.load_tokenizer(out / "checkpoint")  # the checkpoint keeps the chat template
    assert saved.chat_template is not None and "<|im_start|>" in saved.chat_template.source


@pytest.mark.parametrize("debug", [False, True])
def test_a_rank_failure_is_one_line_unless_debugging(finetune, monkeypatch, capsys, debug):
    from actors import RankError

    message = "rank 1 (dp_replicate=0, pp=0, fsdp=1, cp=0, tp=0) failed in train_step: RuntimeError: boom"
    remote = 'Traceback (most recent call last):\n  File "train.py", line 1\nRuntimeError: boom'

    def fail(args, world=None):
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


@pytest.mark.slow
def test_a_run_resumes_from_its_latest_state_under_another_layout(
    ray_session, ray_tables, world, finetune, tmp_path, capsys
):
    """--save-state-every, a lost step (the newest state removed, as if the job died before writing it), then
    --resume on another layout: metrics.jsonl goes on with steps 1..6 once each. Without --resume or --overwrite
    the second launch is refused before the cluster is asked for anything."""
    out = tmp_path / "run"
    common = ["--steps", "6", "--seq-len", "32", "--eval-every", "0", "--output-dir", str(out), "--no-progress"]
    first_layout = ["--tp-size", "1", "--fsdp-size", "2", "--ep-size", "2"]
    assert finetune.main([*common, *first_layout, "--save-state-every", "2"], world(2)) == 0
    assert f"state  {out / 'states' / 'step-00000006'}" in capsys.readouterr().out
    assert sorted(p.name for p in (out / "states").iterdir()) == ["step-00000004", "step-00000006"]  # --keep-last 2
    first = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    shutil.rmtree(out / "states" / "step-00000006")

    before = ray_tables.rank_actors()
    assert finetune.main([*common, *first_layout]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"finetune.py: error: output_dir {out} holds an earlier run"), err
    assert "--resume" in err[0] and "--overwrite" in err[0]
    assert ray_tables.rank_actors() == before
    assert [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()] == first  # untouched

    second_layout = ["--tp-size", "2", "--fsdp-size", "1", "--ep-size", "1"]
    assert finetune.main([*common, *second_layout, "--save-state-every", "2", "--resume"], world(2)) == 0
    printed = capsys.readouterr().out
    assert f"resumed  {out / 'states' / 'step-00000004'}" in printed and "steps  2" in printed
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in records if "eval_loss" in r] == [0, 6]  # the first run's eval of step 6 made again
    assert records[:5] == first[:5]  # kept as they were: the eval before the first step and steps 1-4
    for a, b in zip(first[5:], records[5:], strict=True):  # steps 5 and 6 again, on the other layout
        assert a["lr"] == b["lr"] and a["num_tokens"] == b["num_tokens"]
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
    assert sorted(p.name for p in (out / "states").iterdir()) == ["step-00000004", "step-00000006"]


@pytest.mark.slow
def test_sigint_stops_at_a_step_boundary_saves_the_state_and_frees_every_rank(ray_session, ray_tables, tmp_path):
    """Ctrl-C to a running finetune.py (its own driver process, 2 ranks on the session's Ray): it exits within 30 s with
    130 after the step in progress, leaves a training state to resume from, and no rank actor behind."""
    import os
    import signal
    import subprocess
    import sys
    import time

    before = ray_tables.rank_actors()
    out = tmp_path / "run"
    env = {**os.environ, "RAY_ADDRESS": ray_session.get_runtime_context().gcs_address}
    # 2 ranks (fsdp2): the interrupt and the ranks' release are the subject, not the layout
    command = [sys.executable, str(SCRIPT), "--steps", "500", "--output-dir", str(out), "--no-progress",
               "--cpus-per-rank", "0.25", "--tp-size", "1", "--ep-size", "1"]  # fmt: skip
    driver = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and driver.poll() is None:
        if metrics.is_file() and sum('"loss"' in line for line in metrics.read_text().splitlines()) >= 2:
            break
        time.sleep(0.2)
    assert driver.poll() is None, driver.communicate()
    interrupted = time.monotonic()
    driver.send_signal(signal.SIGINT)
    _, stderr = driver.communicate(timeout=60)
    took = time.monotonic() - interrupted
    print(f"SIGINT -> exit in {took:.1f} s")  # shown with -s
    assert took < 30 and driver.returncode == 130, stderr
    found = re.search(r"interrupted: SIGINT: training stopped after step (\d+); training state in (\S+) ", stderr)
    assert found, stderr
    step = int(found.group(1))
    steps = [r["step"] for r in map(json.loads, metrics.read_text().splitlines()) if "loss" in r]
    assert steps == list(range(1, step + 1))
    assert Path(found.group(2)).name == f"step-{step:08d}" and (Path(found.group(2)) / "raymoe_state.json").is_file()
    deadline = time.monotonic() + 30
    while ray_tables.rank_actors() - before and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not ray_tables.rank_actors() - before


# --- LoRA (--lora-r, --adapter) -------------------------------------------------------------------------------------

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def adapter_files(directory: Path) -> tuple[dict, dict]:
    """``(adapter_config.json, {PEFT key: tensor})`` of a PEFT adapter directory."""
    from safetensors.torch import load_file

    return json.loads((directory / "adapter_config.json").read_text()), load_file(
        directory / "adapter_model.safetensors"
    )


@pytest.mark.slow
def test_a_lora_run_writes_a_peft_adapter_resumes_and_goes_on_from_it(ray_session, world, finetune, tmp_path, capsys):
    """--lora-r 4 on the embedded model (2 ranks, experts over ep): OUTPUT_DIR/adapter is a PEFT directory of every
    attention and expert weight's factors and nothing else, no checkpoint/; --resume from its state of step 2 ends
    with the same adapter; --adapter DIR --save-merged trains that adapter further (its eval before the first step
    is the first run's after the last) and writes the merged checkpoint too."""
    from raymoe.spec.launch import prepare_launch

    out = tmp_path / "run"
    common = ["--steps", "4", "--seq-len", "32", "--eval-every", "0", "--no-progress", "--save-state-every", "2"]
    common += ["--tp-size", "1", "--fsdp-size", "2", "--ep-size", "2"]
    assert finetune.main([*common, "--lora-r", "4", "--output-dir", str(out)], world(2)) == 0
    printed = capsys.readouterr().out
    config, tensors = adapter_files(out / "adapter")
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 4, 8)  # alpha: 2 x r by default
    assert config["target_modules"] == ATTENTION and config["target_parameters"] == EXPERTS
    assert {re.sub(r"\.\d+\.", ".*.", key) for key in tensors} == {
        f"base_model.model.model.layers.*.{path}.lora_{factor}.weight"
        for path in [*(f"self_attn.{name}" for name in ATTENTION), "mlp.experts", "mlp.experts.base_layer"]
        for factor in "AB"
    }  # gate_up_proj nests one base_layer deeper than down_proj in PEFT's keys
    trainable = sum(tensor.numel() for tensor in tensors.values())
    assert f"trainable  {trainable:,} parameters (LoRA r 4, lora_alpha 8)" in printed
    assert f"adapter  {out / 'adapter'}" in printed and "checkpoint  not saved (--save-merged" in printed
    assert not (out / "checkpoint").exists() and (out / "adapter" / "tokenizer.json").is_file()
    base = out / "base-model"
    prepare_launch(base, {"fsdp_size": 2}, lora=str(out / "adapter"))  # names and shapes fit the base: it loads
    first = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert first[-1]["eval_loss"] < first[0]["eval_loss"]  # the adapters learn

    shutil.rmtree(out / "states" / "step-00000004")  # as if the job died after step 4, before its state
    assert finetune.main([*common, "--lora-r", "4", "--output-dir", str(out), "--resume"], world(2)) == 0
    assert f"resumed  {out / 'states' / 'step-00000002'}" in capsys.readouterr().out
    _, resumed = adapter_files(out / "adapter")
    assert resumed.keys() == tensors.keys()
    for key, tensor in tensors.items():
        torch.testing.assert_close(resumed[key], tensor, rtol=1e-5, atol=1e-6)

    more = tmp_path / "more"
    argv = [*common, "--adapter", str(out / "adapter"), "--model", str(base), "--save-merged"]
    assert finetune.main([*argv, "--output-dir", str(more)], world(2)) == 0
    printed = capsys.readouterr().out
    assert f"checkpoint  {more / 'checkpoint'}" in printed and f"adapter  {more / 'adapter'}" in printed
    again = [json.loads(line) for line in (more / "metrics.jsonl").read_text().splitlines()]
    assert again[0]["eval_loss"] == pytest.approx(first[-1]["eval_loss"], rel=1e-5)  # it starts where the first ended
    config, tensors = adapter_files(more / "adapter")
    assert (config["r"], config["lora_alpha"]) == (4, 8) and tensors.keys() == resumed.keys()
    assert (more / "checkpoint" / "model.safetensors").is_file() and (more / "checkpoint" / "config.json").is_file()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--adapter", "{adapter}", "--lora-r", "4"], r"--adapter .*adapter_config.json\); drop --lora-r, or drop"),
        (["--lora-alpha", "8", "--lora-targets", "q_proj"], r"--lora-alpha, --lora-targets without --lora-r: --lora-r"),
        (["--save-merged"], r"--save-merged writes the merged weights of a LoRA run; give --lora-r N or --adapter"),
        (["--quantized-experts", "mxfp4"], r"--quantized-experts mxfp4 keeps the frozen experts of a LoRA run packed"),
        (  # the embedded Qwen3-MoE stores plain experts: refused in from_pretrained, still before any cluster
            ["--lora-r", "4", "--quantized-experts", "mxfp4"],
            r"quantized_experts='mxfp4': this checkpoint's config.json has quantization_config.quant_method=None",
        ),
        (["--lora-r", "0"], r"LoraConfig.r=0 must be an int >= 1"),
        (["--lora-r", "4", "--lora-alpha", "-1"], r"LoraConfig.lora_alpha=-1 must be a number > 0"),
        (
            ["--lora-r", "4", "--lora-targets", "q_prj", "o_proj"],
            r"target_modules entry 'q_prj' matches no module of the model; the nearest names are .*q_proj",
        ),
        (
            ["--lora-r", "4", "--lora-targets", "q_proj", "mlp.experts.up_proj"],
            r"target_parameters entry 'mlp.experts.up_proj' matches no parameter",
        ),
        (["--adapter", "absent"], r"lora='{cwd}/absent' is not a directory"),  # made absolute on the driver
        (["--adapter", "{adapter}"], r"lora='.*adapter': adapter_model.safetensors is missing"),
        (
            ["--adapter", "{other}"],  # checked in from_pretrained, still before any cluster
            r"other/adapter_model.safetensors does not match the LoRA targets of its adapter_config.json on this model",
        ),
    ],
    ids=[
        "adapter_with_lora_r",
        "lora_flags_without_lora_r",
        "save_merged_without_lora",
        "quantized_experts_without_lora",
        "quantized_experts_of_plain_experts",
        "lora_r_zero",
        "negative_alpha",
        "unknown_module",
        "unknown_expert_weight",
        "absent_adapter_relative",
        "adapter_without_weights",
        "adapter_of_another_model",
    ],
)
def test_bad_lora_flags_are_one_error_before_any_cluster(finetune, tmp_path, monkeypatch, capsys, args, message):
    from safetensors.torch import save_file

    import actors.cluster
    import actors.group

    def asked(*_args, **_kwargs):
        raise AssertionError("the cluster was asked for")

    monkeypatch.setattr(actors.cluster, "connect", asked)
    monkeypatch.setattr(actors.group.RayRankGroup, "for_topology", asked)
    monkeypatch.chdir(tmp_path)
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "target_modules": ["q"]}))
    other = tmp_path / "other"  # an adapter of q_proj, but its tensors are another model's
    other.mkdir()
    (other / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "target_modules": ["q_proj"]}))
    save_file({"base_model.model.lm.lora_A.weight": torch.zeros(4, 8)}, other / "adapter_model.safetensors")
    argv = [arg.replace("{adapter}", str(adapter)).replace("{other}", str(other)) for arg in args]
    out = tmp_path / "run"
    assert finetune.main([*argv, "--output-dir", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("finetune.py: error: "), err
    assert re.search(message.replace("{cwd}", re.escape(str(tmp_path))), err[0]), err[0]
    assert not (out / "metrics.jsonl").exists() and not (out / "adapter").exists()


@pytest.mark.parametrize(
    ("family", "attention", "experts"),
    [
        ("embedded", ATTENTION, EXPERTS),
        ("llama_gqa2_llama3_rope_bias", ATTENTION, []),  # dense: no expert weights
        ("qwen2moe_e8_k3_gqa2_shared", ATTENTION, EXPERTS),  # its shared expert's linear layers are not attention
        ("gptoss_e4_k3_gqa2_window5", ATTENTION, EXPERTS),
        (
            "deepseekv3_e8_k3_groups_qlora_yarn",
            ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"],
            EXPERTS,
        ),
        ("deepseekv3_e8_k2_qproj_bias", ["q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"], EXPERTS),
    ],
)
def test_the_default_lora_targets_fit_each_family(finetune, tiny_checkpoint, tmp_path, family, attention, experts):
    """--lora-r 16 alone: r 16, alpha 32, on every linear layer of the attention and every fused expert weight the
    model has, resolved on the driver (a target name that matches nothing would be an error)."""
    from torch import nn

    from raymoe.models import build_model, load_model_config

    path = build_tiny_checkpoint(tmp_path / "tiny") if family == "embedded" else tiny_checkpoint(family)
    model_config = load_model_config(path)
    lora = finetune.lora_of(finetune.parse_args(["--lora-r", "16", "--model", str(path)]), model_config)
    config = lora.spec.config
    assert (config.r, config.lora_alpha) == (16, 32)
    assert list(config.target_modules) == attention and list(config.target_parameters) == experts
    model = build_model(model_config)
    expected = {
        name for name, module in model.named_modules() if isinstance(module, nn.Linear) and ".self_attn." in name
    }
    expected |= {name for name, _ in model.named_parameters() if name.endswith(tuple(f".{e}" for e in experts))}
    assert {target.key for target in lora.spec.targets} == expected
    weights = dict(model.named_parameters())
    shapes = [weights[key if key.endswith(tuple(experts)) else f"{key}.weight"].shape for key in expected]
    # r (in + out) per weight, times the experts of a fused one: the factors' elements over the whole model
    assert lora.trainable == sum(
        16 * (shape[-1] + shape[-2]) * (shape[0] if len(shape) == 3 else 1) for shape in shapes
    )


def test_report_to_flags_reach_the_trainer_config_and_a_bad_one_is_one_error(finetune, tmp_path, monkeypatch, capsys):
    import actors.cluster

    def asked(*_args, **_kwargs):
        raise AssertionError("the cluster was asked for")

    monkeypatch.setattr(actors.cluster, "connect", asked)
    args = ["--output-dir", str(tmp_path), "--report-to", "tensorboard", "wandb", "--run-name", "r1"]
    config = finetune.trainer_config(finetune.parse_args(args))
    assert config.trackers == ("tensorboard", "wandb") and config.run_name == "r1" and config.logging_dir is None
    assert finetune.trainer_config(finetune.parse_args([])).trackers == ()  # default: none
    assert finetune.main(["--output-dir", str(tmp_path), "--report-to", "comet", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "finetune.py: error: TrainerConfig: report_to=['comet'] names unknown tracker(s) comet; allowed: "
        "tensorboard, mlflow, wandb, trackio, all, none"
    ]


def test_ep_mode_masking_loads_with_the_models_own_masked_plan(finetune, tmp_path, monkeypatch, capsys):
    """--ep-mode masking: the ep_plan names this model's routers and experts (what ``raymoe plan`` prints for a masked
    layout); with --ep-size unequal to --tp-size it is CFG-4's one error, before any cluster."""
    import raymoe

    seen = {}

    class Loaded(Exception):
        pass

    def load(_source, distributed_config, **_kwargs):
        seen["layout"] = distributed_config
        raise Loaded

    monkeypatch.setattr(raymoe, "from_pretrained", load)
    args = ["--output-dir", str(tmp_path / "run"), "--no-progress", "--tp-size", "2", "--ep-size", "2"]
    with pytest.raises(Loaded):
        finetune.run(finetune.parse_args([*args, "--ep-mode", "masking"]))
    assert seen["layout"].ep_plan == {
        "model.layers.*.mlp.gate": "ep_router",
        "model.layers.*.mlp.experts": "moe_tp_experts",
    }
    bad = ["--output-dir", str(tmp_path / "bad"), "--tp-size", "2", "--ep-size", "4", "--ep-mode", "masking"]
    assert finetune.main([*bad, "--no-progress"]) == 2
    assert "CFG-4" in capsys.readouterr().err


def test_output_dir_urls(finetune, tmp_path, capsys, s3_bucket):
    """--output-dir file:///x is /x; s3://bucket/run a checked storage URL; an unknown scheme is one error line (Path
    would have made it a local folder 's3:')."""
    from raymoe.checkpoint.storage import StorageUrl

    assert finetune.parse_args(["--output-dir", f"file://{tmp_path}/run"]).output_dir == tmp_path / "run"
    bucket = s3_bucket.removeprefix("s3://")
    assert finetune.parse_args(["--output-dir", f"{s3_bucket}/run"]).output_dir == StorageUrl("s3", f"{bucket}/run")
    with pytest.raises(SystemExit) as exit_code:
        finetune.parse_args(["--output-dir", "nosuch://bucket/run"])
    assert exit_code.value.code == 2
    assert "--output-dir='nosuch://bucket/run': nosuch:// is not a filesystem fsspec knows" in capsys.readouterr().err


@pytest.mark.slow
def test_a_run_writes_its_output_dir_to_s3(ray_session, world, finetune, s3_bucket, capsys):
    """The embedded model fine-tuned with --output-dir s3://...: checkpoint, tokenizer, metrics, plot and the state
    on the bucket, written by the ranks and the driver; nothing under a local folder named 's3:'."""
    import fsspec

    argv = ["--steps", "2", "--seq-len", "32", "--eval-every", "0", "--save-state-every", "2", "--no-progress"]
    assert finetune.main([*argv, "--output-dir", f"{s3_bucket}/run"], world(4)) == 0
    fs, root = fsspec.filesystem("s3"), f"{s3_bucket.removeprefix('s3://')}/run"
    fs.invalidate_cache()
    for name in ("metrics.jsonl", "metrics.png", "checkpoint/model.safetensors", "checkpoint/tokenizer.json"):
        assert fs.exists(f"{root}/{name}"), name
    assert fs.exists(f"{root}/states/step-00000002/raymoe_commit.json")
    steps = [json.loads(line) for line in fs.cat_file(f"{root}/metrics.jsonl").decode().splitlines()]
    assert [r["step"] for r in steps if "loss" in r] == [1, 2]
    assert not (Path.cwd() / "s3:").exists()


def test_the_reshard_flag_reaches_the_layout(finetune):
    assert "fsdp_reshard_after_forward" not in finetune.layout_of(finetune.parse_args([]))  # auto: the config's default
    args = finetune.parse_args(["--fsdp-reshard-after-forward", "always"])
    assert finetune.layout_of(args)["fsdp_reshard_after_forward"] == "always"
