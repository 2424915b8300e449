"""``raymoe export``: a hub checkpoint from a training state, in one process (no Ray, no process group).

The states are written here as the format defines them (raymoe/checkpoint/training_state.py): DCP ``no_dist``
from a raymoe model whose weights were perturbed, so an export that re-read the original checkpoint fails.
"""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint import save as dcp_save

from raymoe.checkpoint import load_model
from raymoe.checkpoint.export import export_state
from raymoe.checkpoint.staging import CheckpointSaveError
from raymoe.checkpoint.training_state import (
    MANIFEST_FILE,
    MOMENTS,
    StateManifest,
    TrainingStateError,
    model_entries,
    model_key,
    optimizer_key,
    rng_key,
    state_dir_name,
)
from raymoe.models.common.decoder import CausalLM

MOE = "moe_e5_k3_gqa2_dense_mid"
GPT_OSS = "gptoss_e4_k3_gqa2_window5"
TIED = "moe_e6_k1_gqa3_tied_step2"  # the state holds model.lm_head.weight too; the export writes it once
LOGITS_ATOL = 1e-5


def _write_state(model: CausalLM, directory: Path, *, step: int = 3) -> Path:
    """``model``'s training state in ``directory`` (one process, as every rank together would write it)."""
    state: dict[str, object] = {model_key(name): value.detach() for name, value in model_entries(model).items()}
    for name, param in model.named_parameters():
        if param.requires_grad:
            state.update({optimizer_key(name, moment): torch.zeros_like(param.detach()) for moment in MOMENTS})
            state[optimizer_key(name, "step")] = torch.tensor(0.0)
    rng = io.BytesIO()
    torch.save({"cpu": torch.get_rng_state()}, rng)
    state[rng_key(0)] = rng.getvalue()  # bytes, as the ranks save it
    with warnings.catch_warnings():  # DCP warns that it saves in one process even when told no_dist
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp_save(state, storage_writer=FileSystemWriter(directory), no_dist=True)
    manifest = StateManifest(
        model_config=dict(model.config.raw),
        step=step,
        optimizer={"lr": 1e-3, "weight_decay": 0.0},
        balance={},
        world_size=1,
        saved_layout={"tp_size": 1},
        extra={"data_position": 0},
    )
    (directory / MANIFEST_FILE).write_text(json.dumps(manifest.to_json()))
    return directory


@pytest.fixture(scope="module")
def trained_state(tiny_checkpoint, tmp_path_factory):
    """``trained_state(name, dtype)``: (the perturbed raymoe model, its state directory), made once per module."""
    made: dict[tuple[str, torch.dtype], tuple[CausalLM, Path]] = {}

    def get(name: str, dtype: torch.dtype = torch.float32) -> tuple[CausalLM, Path]:
        if (name, dtype) not in made:
            model = load_model(tiny_checkpoint(name), dtype=dtype)
            generator = torch.Generator().manual_seed(1)
            with torch.no_grad():
                for param in model.parameters():
                    param.add_(torch.randn(param.shape, generator=generator).to(dtype) * 0.05)
            directory = tmp_path_factory.mktemp(f"state-{name}") / state_dir_name(3)
            made[name, dtype] = model.eval(), _write_state(model, directory)
        return made[name, dtype]

    return get


def _dtypes(directory: Path) -> set[str]:
    found = set()
    for path in directory.glob("*.safetensors"):
        with safe_open(path, "pt") as f:
            found |= {str(f.get_slice(key).get_dtype()) for key in f.keys()}  # noqa: SIM118 -- not a dict
    return found


@pytest.mark.parametrize("name", [MOE, GPT_OSS, TIED])
def test_transformers_loads_the_exported_state(
    name, trained_state, load_hf_model, in_raymoe_layout, tiny_checkpoint, tmp_path
):
    model, state_dir = trained_state(name)
    files = export_state(state_dir, tmp_path / "hub")
    assert [f.name for f in files] == ["model.safetensors"]
    assert sorted(p.name for p in (tmp_path / "hub").iterdir()) == ["config.json", "model.safetensors"]
    config = json.loads((tmp_path / "hub" / "config.json").read_text())
    assert config["dtype"] == "float32" and config["model_type"] == model.model_type
    assert _dtypes(tmp_path / "hub") == {"F32"}  # float32 saved stays float32
    with (
        safe_open(tmp_path / "hub" / "model.safetensors", "pt") as f,
        safe_open(tiny_checkpoint(name) / "model.safetensors", "pt") as g,
    ):
        assert set(f.keys()) == set(g.keys())  # the hub layout transformers writes (per-expert where it does)

    reference = load_hf_model(tmp_path / "hub")
    for key, tensor in reference.state_dict().items():
        assert torch.equal(in_raymoe_layout(model.model_type, key, tensor), model.state_dict()[key]), key
    input_ids = torch.randint(0, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (model(input_ids) - reference(input_ids).logits).abs().max().item()
    assert diff <= LOGITS_ATOL


def test_a_bfloat16_state_exports_bfloat16_in_shards(trained_state, tmp_path):
    model, state_dir = trained_state(MOE, torch.bfloat16)
    files = export_state(state_dir, tmp_path / "hub", max_shard_size=16 * 1024)
    assert len(files) > 1 and (tmp_path / "hub" / "model.safetensors.index.json").is_file()
    assert json.loads((tmp_path / "hub" / "config.json").read_text())["dtype"] == "bfloat16"
    assert _dtypes(tmp_path / "hub") == {"BF16"}
    loaded = load_model(tmp_path / "hub")
    for key, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], tensor), key


def test_the_command_line(trained_state, load_hf_model, tmp_path):
    """Exit 0 and a loadable directory; a state missing a data file: exit 2, one line naming it, nothing written.
    (The two commands run side by side: each spends its seconds importing torch.)"""
    model, state_dir = trained_state(MOE)
    broken = shutil.copytree(state_dir, tmp_path / "broken" / state_dir.name)
    missing = sorted(broken.glob("*.distcp"))[0]
    missing.unlink()

    def run(state: Path, out: Path) -> subprocess.Popen[str]:
        command = [sys.executable, "-m", "raymoe.cli", "export", str(state), str(out), "--max-shard-size", "20000"]
        return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    good, bad = run(state_dir, tmp_path / "out"), run(broken, tmp_path / "bad" / "out")
    (good_out, good_err), (bad_out, bad_err) = good.communicate(timeout=120), bad.communicate(timeout=120)

    assert good.returncode == 0, good_err
    assert not good_err, good_err
    assert good_out.strip() == str(tmp_path / "out")
    reference = load_hf_model(tmp_path / "out")
    input_ids = torch.randint(0, model.config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert (model(input_ids) - reference(input_ids).logits).abs().max().item() <= LOGITS_ATOL

    assert bad.returncode == 2, (bad_out, bad_err)
    lines = bad_err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("raymoe export: error: "), bad_err
    assert str(broken) in lines[0] and missing.name in lines[0] and "missing" in lines[0]
    assert "Traceback" not in bad_err and not bad_out
    assert not (tmp_path / "bad").exists()  # nothing written, not even the parent


def test_a_bad_state_writes_nothing(trained_state, tmp_path):
    _, state_dir = trained_state(MOE)
    out = tmp_path / "out"
    no_manifest = shutil.copytree(state_dir, tmp_path / "no-manifest")
    (no_manifest / MANIFEST_FILE).unlink()
    with pytest.raises(TrainingStateError, match=f"{no_manifest}.*no {MANIFEST_FILE}"):
        export_state(no_manifest, out)

    other_type = shutil.copytree(state_dir, tmp_path / "other-type")
    raw = json.loads((other_type / MANIFEST_FILE).read_text())
    raw["model_config"]["model_type"] = "bert"
    (other_type / MANIFEST_FILE).write_text(json.dumps(raw))
    with pytest.raises(TrainingStateError, match="model_type='bert' is not supported"):
        export_state(other_type, out)

    truncated = shutil.copytree(state_dir, tmp_path / "truncated")
    data = sorted(truncated.glob("*.distcp"))[0]
    data.write_bytes(data.read_bytes()[:100])
    with pytest.raises(TrainingStateError, match=f"{data.name} is truncated"):
        export_state(truncated, out)

    with pytest.raises(CheckpointSaveError, match="into itself"):
        export_state(state_dir, state_dir)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["no-manifest", "other-type", "truncated"]


def test_export_into_a_checkpoint_keeps_its_tokenizer(trained_state, tiny_checkpoint, tmp_path):
    model, state_dir = trained_state(MOE)
    out = shutil.copytree(tiny_checkpoint(MOE), tmp_path / "ckpt")
    (out / "tokenizer.json").write_text('{"version": "1.0"}')
    export_state(state_dir, out)
    assert (out / "tokenizer.json").read_text() == '{"version": "1.0"}'
    loaded = load_model(out)
    for key, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], tensor), key


def test_a_mixed_precision_state_exports_the_checkpoints_dtype(trained_state, tmp_path):
    """A bf16 checkpoint trained under bf16-mixed holds float32 masters; the manifest's ``checkpoint_dtype`` makes
    the export what ``save_pretrained`` would write (bf16), and without it (an older state) it stays float32."""
    model, state_dir = trained_state(MOE)  # float32 masters
    state = shutil.copytree(state_dir, tmp_path / "state" / state_dir.name)
    manifest = json.loads((state / MANIFEST_FILE).read_text())
    export_state(state, tmp_path / "old")
    assert _dtypes(tmp_path / "old") == {"F32"}
    (state / MANIFEST_FILE).write_text(json.dumps({**manifest, "checkpoint_dtype": "bfloat16"}))
    export_state(state, tmp_path / "hub")
    assert json.loads((tmp_path / "hub" / "config.json").read_text())["dtype"] == "bfloat16"
    assert _dtypes(tmp_path / "hub") == {"BF16"}
    loaded = load_model(tmp_path / "hub")
    for key, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], tensor.to(torch.bfloat16)), key
    (state / MANIFEST_FILE).write_text(json.dumps({**manifest, "checkpoint_dtype": "bfloat17"}))
    with pytest.raises(TrainingStateError, match="checkpoint_dtype='bfloat17' is not a torch dtype"):
        export_state(state, tmp_path / "bad")
