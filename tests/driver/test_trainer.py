"""raymoe.Trainer on a local Ray: the same run under two layouts gives the same tokens and losses; bad input
fails on the driver before any step."""

from __future__ import annotations

import json

import pytest
import torch

import raymoe
from raymoe import PackedData, Trainer, TrainerConfig

STEPS, BATCH, SEQ = 3, 8, 32


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return raymoe.build_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


def ragged_rows(num_rows: int, seed: int) -> PackedData:
    """Random rows with right padding of many lengths: data-parallel ranks get uneven token counts."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (num_rows, SEQ), generator=gen)
    lengths = torch.randint(2, SEQ + 1, (num_rows,), generator=gen)
    mask = (torch.arange(SEQ)[None, :] < lengths[:, None]).to(torch.int64)
    return PackedData(ids, mask)


def run(load_on_world, tiny, layout, accumulation, out_dir, train, held_out):
    config = TrainerConfig(
        output_dir=out_dir,
        steps=STEPS,
        global_batch_size=BATCH,
        gradient_accumulation_steps=accumulation,
        lr=1e-2,
        warmup_steps=1,
        # The aux loss of 2 micro-batches is the mean of theirs, not the whole batch's (raymoe.rank.train):
        # the two runs below compare exactly only without it. It is still measured and reported.
        balance="none",
        save_every=2,  # a checkpoint after step 2, and one at the end
        progress=False,
    )
    with load_on_world(tiny, layout) as model:
        trainer = Trainer(model, train, config, eval_data=held_out)
        summary = trainer.fit()
        odd_rows = trainer.evaluate(held_out.rows(slice(0, 3)))  # 3 rows: the last eval batch is filled up
    return summary, odd_rows


def test_same_tokens_and_losses_under_every_layout(load_on_world, tiny, tmp_path):
    train, held_out = ragged_rows(20, seed=1), ragged_rows(5, seed=2)
    one, odd_one = run(load_on_world, tiny, {}, 1, tmp_path / "one", train, held_out)
    # tp2/fsdp2/ep2: token dispatch, and gradient accumulation over 2 micro-batches per rank.
    layout = {"tp_size": 2, "fsdp_size": 2, "ep_size": 2}
    sharded, odd_sharded = run(load_on_world, tiny, layout, 2, tmp_path / "sharded", train, held_out)

    steps_one = [r for r in one.history if "loss" in r]
    steps_tp = [r for r in sharded.history if "loss" in r]
    assert [r["step"] for r in steps_one] == [1, 2, 3]
    assert [r["num_tokens"] for r in steps_one] == [r["num_tokens"] for r in steps_tp]
    # Each step's tokens are the label tokens of 8 distinct rows of the data, never more.
    assert all(0 < r["num_tokens"] <= BATCH * (SEQ - 1) for r in steps_one)
    assert one.num_tokens == sum(r["num_tokens"] for r in steps_one)
    for a, b in zip(steps_one, steps_tp, strict=True):
        assert a["lr"] == b["lr"]
        assert abs(a["loss"] - b["loss"]) <= 1e-4 * a["loss"], (a, b)
        assert b["tokens_per_s"] == pytest.approx(b["num_tokens"] / b["step_time_s"])
    assert one.eval_loss_before == pytest.approx(sharded.eval_loss_before, rel=1e-5)
    assert one.eval_loss_after == pytest.approx(sharded.eval_loss_after, rel=1e-4)
    assert odd_one == pytest.approx(odd_sharded, rel=1e-4)
    assert one.last_loss < one.first_loss

    # the MoE metrics, the JSONL file (one object per step, plus the eval before the first), the plot, the save
    assert 1.0 <= steps_tp[0]["max_expert_imbalance"] <= 8 and steps_tp[0]["max_rank_imbalance"] >= 1.0
    # routing telemetry: the same under both layouts (routing depends on the rows, not on who holds them)
    for a, b in zip(steps_one, steps_tp, strict=True):
        assert a["expert_load"] == b["expert_load"] and a["dropped_pairs"] == b["dropped_pairs"] == 0
        assert b["dead_experts"] == 0 and a["aux_loss"] > 0 and b["aux_loss"] > 0  # measured, not trained on
        assert len(b["expert_load"]) == 2 and sum(b["expert_load"][0]) == BATCH * SEQ * 2  # every pair, padding too
        assert a["loss"] == a["lm_loss"] and b["loss"] == b["lm_loss"]
    lines = [json.loads(line) for line in (tmp_path / "sharded" / "metrics.jsonl").read_text().splitlines()]
    assert lines == sharded.history and lines[0] == {"step": 0, "eval_loss": sharded.eval_loss_before}
    assert lines[-1]["eval_loss"] == sharded.eval_loss_after
    png = sharded.plot_file.read_bytes()
    assert png[:4] == b"\x89PNG" and int.from_bytes(png[16:20], "big") == 1600  # four panels: the heatmap is drawn
    assert (sharded.checkpoint / "model.safetensors").is_file()


def test_bad_input_fails_before_any_step(load_on_world, tiny, tmp_path):
    good = ragged_rows(16, seed=3)
    with load_on_world(tiny, {"fsdp_size": 2}) as model:

        def trainer(data, **overrides):
            config = TrainerConfig(output_dir=tmp_path, steps=2, progress=False, **overrides)
            return Trainer(model, data, config)

        too_long = PackedData.from_rows(torch.zeros(8, 513, dtype=torch.long))
        with pytest.raises(
            ValueError, match=r"train data: seq_len=513 exceeds the model's max_position_embeddings=512"
        ):
            trainer(too_long)
        with pytest.raises(ValueError, match=r"train data must be token ids in \[0, 264\), got values in \[300, 300\]"):
            trainer(PackedData.from_rows(torch.full((8, 4), 300)))
        with pytest.raises(ValueError, match=r"4 sequences of 32 tokens, but global_batch_size=8 needs at least 8"):
            trainer(good.rows(slice(0, 4)))
        with pytest.raises(ValueError, match=r"global_batch_size=2 must be at least .* = 2 \* 2 = 4"):
            trainer(good, global_batch_size=2, gradient_accumulation_steps=2)
        with pytest.raises(ValueError, match=r"schedule: warmup_steps=5 must be an int in \[0, steps=2\]"):
            trainer(good, warmup_steps=5)
        # Nothing reached the ranks: the optimizer was never configured, so no step could have run.
        with pytest.raises(RuntimeError, match="configure_training"):
            model.train_step(good.input_ids[:2])
        assert not (tmp_path / "metrics.jsonl").exists()
