"""save_state / load_state: the whole training state, resumed exactly under another layout and world size.

Each case trains 6 AdamW steps straight on one layout, and 3 steps + ``save_state`` + a new handle on another
layout (another world size too) + ``load_state`` + 3 steps: the losses of steps 4-6 and the final weights must
match the straight run. Gradient clipping is on, so the moments, step counts and the clipping all have to be
restored for the losses to agree.

Across layouts the sums of the gradient reductions run in another order, so the weights agree to float32
rounding amplified by Adam (``WEIGHT_TOL``); on the same layout the resumed run is bit for bit the straight one,
which no missing piece of state would allow.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from raymoe.checkpoint.training_state import MANIFEST_FILE, TrainingStateError

MOE = "moe_e8_k2_mha"  # Qwen3-MoE, 8 experts: packed gate_up under tensor parallelism
GPT_OSS = "gptoss_e4_k3_gqa2_window5"
STEPS, ROWS, SEQ = 6, 8, 10
TOL = 1e-6
WEIGHT_TOL = 5e-5  # max abs; straight 6-step runs of two layouts differ by up to 1.4e-5 (k_proj, tp2 vs one rank)

# (saved under, resumed under): the three moves, plus a packed-weight TP split on both sides
MOVES = {
    "tp2_fsdp2_ep2_to_fsdp2_ep2": ({"tp_size": 2, "fsdp_size": 2, "ep_size": 2}, {"fsdp_size": 2, "ep_size": 2}),
    "fsdp4_ep4_to_tp4_ep4_masked": ({"fsdp_size": 4, "ep_size": 4}, {"tp_size": 4, "ep_size": 4, "tp_plan": {}}),
    "hsdp_to_fsdp": ({"dp_replicate_size": 2, "fsdp_size": 2}, {"fsdp_size": 2}),
    "tp2_fsdp2_to_tp4": ({"tp_size": 2, "fsdp_size": 2}, {"tp_size": 4}),
    # pipelines (issue 19): every stage saves its own parameters; another pp size reads them all
    "pp2_tp2_to_fsdp2": ({"pp_size": 2, "tp_size": 2}, {"fsdp_size": 2}),
    "fsdp2_ep2_to_pp2_fsdp2": ({"fsdp_size": 2, "ep_size": 2}, {"pp_size": 2, "fsdp_size": 2}),
}
# context parallelism (issue 32): parameters shard over fsdp x cp; a state saved with one cp size loads under another
CP_SEQ = 16  # a multiple of 2 * cp_size for cp 2 and 4
CP_MOVES = {
    "cp2_fsdp2_ep4_to_cp4": ({"cp_size": 2, "fsdp_size": 2, "ep_size": 4}, {"cp_size": 4}),
    "cp4_to_fsdp2_ep2": ({"cp_size": 4}, {"fsdp_size": 2, "ep_size": 2}),
    "fsdp2_to_cp2_tp2_sp": ({"fsdp_size": 2}, {"cp_size": 2, "tp_size": 2, "enable_sequence_parallel": True}),
}


def _full_weights(ctx) -> dict[str, torch.Tensor]:
    """This rank's parameters (of every pipeline stage it runs), whole."""
    from torch.distributed.tensor import DTensor

    return {
        name: (p.full_tensor() if isinstance(p, DTensor) else p.detach()).clone()
        for name, p in ctx.require_model().named_parameters()
    }


def _merged(per_rank: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The whole model's weights from every rank's (a pipeline spreads them over its stages)."""
    return {name: weight for weights in per_rank for name, weight in weights.items()}


def _train(model, data, steps: range) -> list[float]:
    return [model.train_step(ids, attention_mask=mask)["loss"] for ids, mask in (data[i] for i in steps)]


def _configure(model) -> None:
    model.configure_training(lr=1e-3, weight_decay=0.1, max_grad_norm=0.5)


@pytest.fixture(scope="module")
def straight_run(load_on_world, tiny_checkpoint, padded_batches):
    """Six steps on one rank: the losses and final weights every resumed run must reproduce."""
    results = {}

    def run(name: str, seq: int = SEQ):
        if (name, seq) not in results:
            directory = tiny_checkpoint(name)
            vocab = json.loads((directory / "config.json").read_text())["vocab_size"]
            data = padded_batches(vocab, steps=STEPS, rows=ROWS, seq=seq)
            with load_on_world(directory, {}) as model:
                _configure(model)
                losses = _train(model, data, range(STEPS))
                weights = model.run_on_ranks(_full_weights)[0]
            results[name, seq] = (data, losses, weights)
        return results[name, seq]

    return run


@pytest.mark.parametrize("move", list(MOVES) + list(CP_MOVES))
def test_resume_under_another_layout_equals_the_straight_run(
    move, straight_run, load_on_world, tiny_checkpoint, tmp_path
):
    before, after = MOVES[move] if move in MOVES else CP_MOVES[move]
    data, losses, weights = straight_run(MOE, SEQ if move in MOVES else CP_SEQ)
    state = tmp_path / "state"
    with load_on_world(tiny_checkpoint(MOE), before) as model:
        _configure(model)
        first = _train(model, data, range(3))
        assert model.save_state(state, extra={"rows_seen": 24}) == state
    assert first == pytest.approx(losses[:3], rel=TOL)
    manifest = json.loads((state / MANIFEST_FILE).read_text())
    assert manifest["step"] == 3 and manifest["extra"] == {"rows_seen": 24}
    with load_on_world(tiny_checkpoint(MOE), after) as model:
        restored = model.load_state(state)
        assert restored.step == 3 and model.step == 3 and restored.extra == {"rows_seen": 24}
        resumed = _train(model, data, range(3, STEPS))
        final = _merged(model.run_on_ranks(_full_weights))
    assert set(final) == set(weights)
    assert resumed == pytest.approx(losses[3:], rel=TOL), (resumed, losses[3:])
    for name, expected in weights.items():
        assert (final[name] - expected).abs().max().item() <= WEIGHT_TOL, name


def test_resume_on_the_same_layout_is_bit_exact(load_on_world, tiny_checkpoint, padded_batches, tmp_path):
    layout = {"tp_size": 2, "fsdp_size": 2, "ep_size": 2}
    directory = tiny_checkpoint(MOE)
    data = padded_batches(
        json.loads((directory / "config.json").read_text())["vocab_size"], steps=STEPS, rows=ROWS, seq=SEQ
    )
    with load_on_world(directory, layout) as model:
        _configure(model)
        losses = _train(model, data, range(STEPS))
        weights = model.run_on_ranks(_full_weights)[0]
    with load_on_world(directory, layout) as model:
        _configure(model)
        _train(model, data, range(3))
        model.save_state(tmp_path / "state")
    with load_on_world(directory, layout) as model:
        model.load_state(tmp_path / "state")
        resumed = _train(model, data, range(3, STEPS))
        final = _merged(model.run_on_ranks(_full_weights))
    assert set(final) == set(weights)
    assert resumed == losses[3:]
    assert all(torch.equal(final[name], expected) for name, expected in weights.items())


def test_gpt_oss_resumes_with_biases_sinks_and_async_save(straight_run, load_on_world, tiny_checkpoint, tmp_path):
    """gpt-oss (expert biases, attention sinks): an asynchronous save under tp2/fsdp2 keeps the values of the step
    it was taken at while training goes on, and resumes on fsdp2/ep2."""
    data, losses, weights = straight_run(GPT_OSS)
    state = tmp_path / "state"
    with load_on_world(tiny_checkpoint(GPT_OSS), {"tp_size": 2, "fsdp_size": 2}) as model:
        _configure(model)
        _train(model, data, range(3))
        model.save_state(state, async_save=True)
        _train(model, data, range(3, 5))  # changes every weight while the save writes
        assert model.wait_for_save() == state
    with load_on_world(tiny_checkpoint(GPT_OSS), {"fsdp_size": 2, "ep_size": 2}) as model:
        model.load_state(state)
        resumed = _train(model, data, range(3, STEPS))
        final = _merged(model.run_on_ranks(_full_weights))
    assert set(final) == set(weights)
    assert resumed == pytest.approx(losses[3:], rel=TOL)
    for name, expected in weights.items():
        assert (final[name] - expected).abs().max().item() <= WEIGHT_TOL, name


def test_damaged_states_fail_on_the_driver_and_change_nothing(load_on_world, tiny_checkpoint, padded_batches, tmp_path):
    """A removed data file, a truncated one, a state of another model, no manifest: one TrainingStateError naming the
    directory, raised before any rank reads; the weights stay as they were and the handle keeps training."""
    directory = tiny_checkpoint(MOE)
    vocab = json.loads((directory / "config.json").read_text())["vocab_size"]
    data = padded_batches(vocab, steps=2, rows=ROWS, seq=SEQ)
    good = tmp_path / "good"
    other = tmp_path / "other"
    with load_on_world(tiny_checkpoint(GPT_OSS), {"fsdp_size": 2}) as model:
        _configure(model)
        model.save_state(other)
    with load_on_world(directory, {"fsdp_size": 2}) as model:
        _configure(model)
        _train(model, data, range(1))
        model.save_state(good)
        _train(model, data, range(1, 2))
        weights = model.run_on_ranks(_full_weights)[0]

        def damaged(name: str, harm) -> Path:
            copy = tmp_path / name
            copy.mkdir()
            for file in good.iterdir():
                (copy / file.name).write_bytes(file.read_bytes())
            harm(copy)
            return copy

        cases = {
            "removed": (
                damaged("removed", lambda d: (d / "__1_0.distcp").unlink()),
                r"data file __1_0\.distcp is missing",
            ),
            "truncated": (
                damaged(
                    "truncated", lambda d: (d / "__0_0.distcp").write_bytes((d / "__0_0.distcp").read_bytes()[:100])
                ),
                r"data file __0_0\.distcp is truncated \(100 bytes",
            ),
            "no_manifest": (
                damaged("no_manifest", lambda d: (d / MANIFEST_FILE).unlink()),
                r"has no raymoe_state\.json",
            ),
            "other_model": (other, r"is of a 'gpt_oss' model; this model is 'qwen3_moe'"),
            "missing_dir": (tmp_path / "nowhere", r"does not exist"),
        }
        for name, (path, message) in cases.items():
            with pytest.raises(TrainingStateError, match=message) as caught:
                model.load_state(path)
            assert str(path) in str(caught.value), name
        assert model.step == 2
        unchanged = model.run_on_ranks(_full_weights)[0]
        assert all(torch.equal(unchanged[n], w) for n, w in weights.items())
        model.load_state(good)  # the good one still loads into the same handle, and it trains on
        assert model.step == 1
        model.train_step(*data[1])


def _correction_biases(ctx) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {
        name: (p.full_tensor() if isinstance(p, DTensor) else p.detach()).clone()
        for name, p in ctx.require_model().model.named_parameters()
        if name.endswith("e_score_correction_bias")
    }


def test_bias_balancing_resumes_with_its_correction_biases(load_on_world, tiny_checkpoint, padded_batches, tmp_path):
    """GLM-4.5 with bias balancing: the selection biases bias balancing moved are part of the state; saved under
    fsdp2/ep2 (world 2) and resumed on one rank, the run goes on as if never stopped."""
    glm = tiny_checkpoint("glm4moe_e8_k3_shared2_qknorm")
    data = padded_batches(json.loads((glm / "config.json").read_text())["vocab_size"], steps=STEPS, rows=ROWS, seq=SEQ)

    def configure(model):
        model.configure_training(lr=1e-3, weight_decay=0.1, max_grad_norm=0.5, balance="bias", bias_update_rate=1e-2)

    with load_on_world(glm, {}) as model:
        configure(model)
        losses = _train(model, data, range(STEPS))
        biases = model.run_on_ranks(_correction_biases)[0]
    assert biases and all(b.abs().sum() > 0 for b in biases.values())  # bias balancing moved them
    with load_on_world(glm, {"fsdp_size": 2, "ep_size": 2}) as model:
        configure(model)
        _train(model, data, range(3))
        model.save_state(tmp_path / "state")
    with load_on_world(glm, {}) as model:
        model.load_state(tmp_path / "state")
        assert model.balance.bias_update_rate == 1e-2  # the balance settings come back with the state
        resumed = _train(model, data, range(3, STEPS))
        final = model.run_on_ranks(_correction_biases)[0]
    assert resumed == pytest.approx(losses[3:], rel=TOL)
    assert all(torch.equal(final[name], b) for name, b in biases.items())
