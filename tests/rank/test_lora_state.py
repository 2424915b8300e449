"""LoRA training states (issue 30): the adapters, their AdamW moments and what a run moves, not the frozen base;
the base's fingerprint and the adapter config are checked on resume; resuming (on one rank, and on another layout)
gives the losses of the uninterrupted run.
"""

import json
import shutil
from pathlib import Path

import pytest
from torch.distributed.checkpoint import FileSystemReader

from raymoe.checkpoint.training_state import MANIFEST_FILE, TrainingStateError, expected_entries
from raymoe.models.common.lora import is_adapter_name

QWEN = "moe_e8_k2_mha"  # 8 experts: split over ep 2 and 4
DEEPSEEK = "deepseekv3_e8_k2_qproj_bias"  # routers with a selection bias (moved by bias balancing, not by grads)
LORA = {
    "r": 4,
    "lora_alpha": 8,
    "target_modules": ["q_proj", "v_proj", "o_proj"],
    "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
    "init_lora_weights": False,  # B != 0: every factor has a gradient from the first step
}
STEPS, ROWS, SEQ = 4, 8, 10


def _train(model, batches) -> list[float]:
    return [model.train_step(ids, attention_mask=mask)["loss"] for ids, mask in batches]


def _configure(model) -> None:
    model.configure_training(lr=1e-3, weight_decay=0.1, max_grad_norm=None, balance="none")


def _keys(state: Path) -> set[str]:
    return set(FileSystemReader(state).read_metadata().state_dict_metadata)


def test_a_lora_state_holds_the_adapters_not_the_base(load_local, tiny_checkpoint, padded_batches, tmp_path):
    directory = tiny_checkpoint(QWEN)
    with load_local(directory, lora=LORA) as model:
        _configure(model)
        _train(model, padded_batches(96, steps=1, rows=ROWS, seq=SEQ))
        model.save_state(tmp_path / "state")
    keys = _keys(tmp_path / "state")
    weights = {key.removeprefix("model.") for key in keys if key.startswith("model.")}
    assert weights and all(is_adapter_name(name) for name in weights), sorted(weights)[:5]
    assert {key.split(".", 1)[1].rsplit(".", 1)[0] for key in keys if key.startswith("optim.")} == weights
    manifest = json.loads((tmp_path / "state" / MANIFEST_FILE).read_text())
    assert manifest["lora"]["r"] == 4 and manifest["lora"]["target_parameters"] == LORA["target_parameters"]
    assert manifest["base"]["source"] == str(directory) and len(manifest["base"]["tensors"]) == 4


def test_a_lora_state_keeps_what_a_run_moves_beside_the_adapters(tiny_checkpoint):
    """The router's selection bias is no base weight LoRA froze (bias balancing moves it): it stays in the state."""
    from raymoe.spec.launch import prepare_launch

    spec = prepare_launch(tiny_checkpoint(DEEPSEEK), {}, lora={"target_modules": ["q_proj"]})
    models = [key for key in expected_entries(spec.build_meta_model()) if key.startswith("model.")]
    biases = [key for key in models if key.endswith("e_score_correction_bias")]
    assert biases and sorted(models) == sorted(biases + [key for key in models if is_adapter_name(key)])
    full = [key for key in expected_entries(prepare_launch(tiny_checkpoint(DEEPSEEK), {}).build_meta_model())]
    assert len(full) > 3 * len(models)  # the base weights and their moments are in a full state


def test_resume_gives_the_losses_of_the_uninterrupted_run(load_local, tiny_checkpoint, padded_batches, tmp_path):
    directory = tiny_checkpoint(QWEN)
    batches = padded_batches(96, steps=STEPS, rows=ROWS, seq=SEQ)
    with load_local(directory, lora=LORA) as model:
        _configure(model)
        whole = _train(model, batches)
    with load_local(directory, lora=LORA) as model:
        _configure(model)
        first = _train(model, batches[:2])
        model.save_state(tmp_path / "state")
    with load_local(directory, lora=LORA) as model:  # fresh factors: what load_state reads must replace them
        model.load_state(tmp_path / "state")
        assert model.step == 2
        rest = _train(model, batches[2:])
    assert first + rest == pytest.approx(whole, rel=1e-6)


@pytest.mark.ray
def test_resume_on_another_layout_gives_the_same_losses(
    load_local, load_on_world, tiny_checkpoint, padded_batches, tmp_path
):
    directory = tiny_checkpoint(QWEN)
    batches = padded_batches(96, steps=STEPS, rows=ROWS, seq=SEQ)
    with load_local(directory, lora=LORA) as model:
        _configure(model)
        whole = _train(model, batches)
    with load_on_world(directory, {"fsdp_size": 4, "ep_size": 4}, lora=LORA) as model:
        _configure(model)
        first = _train(model, batches[:2])
        model.save_state(tmp_path / "state")
    with load_on_world(directory, {"tp_size": 2, "fsdp_size": 2, "ep_size": 2}, lora=LORA) as model:
        model.load_state(tmp_path / "state")
        rest = _train(model, batches[2:])
    assert first + rest == pytest.approx(whole, rel=1e-5)


def _other_base(directory: Path, tmp_path: Path, make_hf_model) -> Path:
    """The same config as ``directory``, other weights."""
    other = tmp_path / "other-base"
    make_hf_model(QWEN, seed=1).save_pretrained(other)
    shutil.copy(directory / "config.json", other / "config.json")
    return other


def test_resume_refuses_a_state_that_does_not_fit(load_local, tiny_checkpoint, padded_batches, make_hf_model, tmp_path):
    """Another adapter config, another base, a full state into a LoRA model and the reverse: one error each,
    before any rank reads, and the model trains on unchanged."""
    directory = tiny_checkpoint(QWEN)
    batch = padded_batches(96, steps=1, rows=ROWS, seq=SEQ)
    with load_local(directory, lora=LORA) as model:
        _configure(model)
        _train(model, batch)
        model.save_state(tmp_path / "lora-state")
    with load_local(directory) as model:
        _configure(model)
        _train(model, batch)
        model.save_state(tmp_path / "full-state")
        with pytest.raises(TrainingStateError, match=r"holds LoRA adapters \(r=4\) trained on .*from_pretrained"):
            model.load_state(tmp_path / "lora-state")
        assert model.step == 1
    cases = [
        (directory, {**LORA, "r": 8}, "full-state", "is a full fine-tuning state"),
        (directory, {**LORA, "r": 8}, "lora-state", r"other LoRA adapters than this model's: r=4 in the state, 8"),
        (
            _other_base(directory, tmp_path, make_hf_model),
            LORA,
            "lora-state",
            r"trained on .*moe_e8_k2_mha.*is another checkpoint: tensor .* holds other values",
        ),
    ]
    for base, lora, state, message in cases:
        with load_local(base, lora=lora) as model:
            _configure(model)
            with pytest.raises(TrainingStateError, match=message):
                model.load_state(tmp_path / state)
            assert model.step == 0
            assert _train(model, batch)[0] > 0
