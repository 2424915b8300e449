"""``raymoe export --adapter`` / ``--merge``: a LoRA training state out of the cluster, in one process.

The state comes from a trained LoRA model (one rank in this process); the exports must equal what that model's own
``save_adapter`` and ``save_pretrained`` wrote (the PEFT adapter, the merged hub checkpoint), tensor for tensor.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from raymoe.checkpoint.training_state import TrainingStateError
from raymoe.driver.adapter_export import export_adapter, export_merged

QWEN = "moe_e8_k2_mha"
GPT_OSS = "gptoss_e4_k3_gqa2_window5"  # hub experts transposed (x @ W)
LORA = {
    "r": 4,
    "lora_alpha": 8,
    "target_modules": ["q_proj", "o_proj"],
    "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
    "init_lora_weights": False,
}


def _weights(directory: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=0, msg=key)


@pytest.fixture(scope="module")
def trained(tiny_checkpoint, padded_batches, tmp_path_factory):
    """``{name: (base, state, adapter, merged)}``: a LoRA run of 2 steps, its state, save_adapter, save_pretrained."""
    import raymoe
    from raymoe.rank.local import LocalRankGroup

    made = {}
    for name in (QWEN, GPT_OSS):
        root = tmp_path_factory.mktemp(f"lora-{name}")
        world = LocalRankGroup()
        try:
            with raymoe.from_pretrained(tiny_checkpoint(name), world=world, lora=LORA) as model:
                model.configure_training(lr=1e-2, balance="none")
                for ids, mask in padded_batches(96, steps=2, rows=4, seq=8):
                    model.train_step(ids, attention_mask=mask)
                model.save_state(root / "state")
                model.save_adapter(root / "adapter")
                model.save_pretrained(root / "merged")
        finally:
            world.shutdown()
        made[name] = (tiny_checkpoint(name), root / "state", root / "adapter", root / "merged")
    return made


@pytest.mark.parametrize("name", [QWEN, GPT_OSS])
def test_the_adapter_equals_save_adapter(trained, name, tmp_path):
    _, state, adapter, _ = trained[name]
    export_adapter(state, tmp_path / "out")
    _assert_same(_weights(tmp_path / "out"), _weights(adapter))
    config = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
    assert config == json.loads((adapter / "adapter_config.json").read_text())


@pytest.mark.parametrize("name", [QWEN, GPT_OSS])
def test_the_merge_equals_save_pretrained(trained, name, tmp_path):
    base, state, _, merged = trained[name]
    export_merged(state, tmp_path / "out", base)
    got, want = _weights(tmp_path / "out"), _weights(merged)
    _assert_same(got, want)
    assert any(not torch.equal(want[key], value) for key, value in _weights(base).items())  # the merge changed W


def _cli(*args: object) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "raymoe.cli", "export", *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, timeout=300)


def test_the_command_line(trained, tmp_path):
    base, state, adapter, merged = trained[QWEN]
    done = _cli("--adapter", state, tmp_path / "adapter")
    assert done.returncode == 0, done.stderr
    _assert_same(_weights(tmp_path / "adapter"), _weights(adapter))
    done = _cli("--merge", state, tmp_path / "merged", "--base", base)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(tmp_path / "merged")
    _assert_same(_weights(tmp_path / "merged"), _weights(merged))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((), r"holds LoRA adapters, not the base weights: `raymoe export --adapter"),
        (("--merge",), r"--merge needs --base BASE"),
        (("--base", "BASE"), r"--merge needs --base BASE"),
        (("--adapter", "--merge"), r"not allowed with argument"),
    ],
    ids=["plain", "merge-without-base", "base-without-merge", "both"],
)
def test_the_command_line_refuses_bad_requests(trained, tmp_path, capsys, args, message):
    """The command line's ``main`` in this process (test_the_command_line runs ``python -m raymoe.cli`` itself: a
    process each would be ~2.5 s of importing torch to print one line)."""
    from raymoe.cli import main

    _, state, _, _ = trained[QWEN]
    try:
        code = main(["export", str(state), str(tmp_path / "out"), *args])
    except SystemExit as exited:  # argparse's own refusals
        code = exited.code
    err = capsys.readouterr().err
    assert code == 2 and not (tmp_path / "out").exists()
    last = err.strip().splitlines()[-1]  # argparse's usage lines may come before the one error line
    assert last.startswith("raymoe export: error: ") and re.search(message, last), err


def test_a_merge_onto_another_base_writes_nothing(trained, make_hf_model, tmp_path):
    base, state, _, _ = trained[QWEN]
    other = tmp_path / "other"
    make_hf_model(QWEN, seed=1).save_pretrained(other)
    shutil.copy(base / "config.json", other / "config.json")
    with pytest.raises(TrainingStateError, match=r"--base .* is not the checkpoint .* tensor .* holds other values"):
        export_merged(state, tmp_path / "out", other)
    assert not (tmp_path / "out").exists()


def test_a_full_state_has_no_adapter(tiny_checkpoint, load_local, padded_batches, tmp_path):
    with load_local(tiny_checkpoint(QWEN)) as model:
        model.configure_training(lr=1e-3)
        ids, mask = padded_batches(96, steps=1, rows=4, seq=8)[0]
        model.train_step(ids, attention_mask=mask)
        model.save_state(tmp_path / "state")
    for export in (export_adapter, lambda state, out: export_merged(state, out, tiny_checkpoint(QWEN))):
        with pytest.raises(TrainingStateError, match=r"is a full fine-tuning state .*`raymoe export STATE_DIR"):
            export(tmp_path / "state", tmp_path / "out")
    assert not (tmp_path / "out").exists()
