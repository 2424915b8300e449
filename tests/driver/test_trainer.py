"""raymoe.Trainer on a local Ray: the same run under two layouts gives the same tokens and losses; bad input
fails on the driver before any step."""

from __future__ import annotations

import json
import re

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


def test_chat_rows_train_and_evaluate_on_their_answers_only(load_on_world, tiny, tmp_path):
    """Rows with labels (assistant answers) and document ids: each step counts its rows' answer tokens, and the
    Trainer's evaluation (a short last batch filled with blank rows) is the handle's over the same rows."""
    from raymoe.driver.batch_order import batch_indices
    from raymoe.driver.tiny import tiny_tokenizer

    lines = []
    for i in range(24):
        question, answer = f"What is {i} + {i}?", f"{i} + {i} = {2 * i}."
        messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        lines.append(json.dumps({"messages": messages}) + "\n")
    (tmp_path / "chat.jsonl").write_text("".join(lines))
    data = raymoe.load_dataset(tmp_path / "chat.jsonl", 96, tiny_tokenizer(), cache_dir=False)
    assert data.labels is not None and data.document_ids is not None
    train, held_out = data.split(0.25)
    config = TrainerConfig(
        output_dir=tmp_path / "run", steps=2, global_batch_size=4, lr=1e-2, warmup_steps=0, balance="none",
        progress=False, save_at_end=False,
    )  # fmt: skip
    with load_on_world(tiny, {"tp_size": 2, "fsdp_size": 2}) as model:
        trainer = Trainer(model, train, config, eval_data=held_out)
        steps = [r for r in trainer.fit().history if "loss" in r]
        batches = batch_indices(train.num_sequences, 4, seed=0)
        assert [r["num_tokens"] for r in steps] == [train.rows(next(batches)).num_label_tokens for _ in steps]
        assert all(r["num_tokens"] < 4 * 95 / 2 for r in steps)  # answers only: well under half the tokens
        odd = held_out.rows(slice(0, 3))  # 3 rows, 2 data-parallel ranks: the eval batch is filled up
        direct = model.evaluate(
            odd.input_ids, labels=odd.labels, attention_mask=odd.attention_mask, document_ids=odd.document_ids
        )
        assert direct["num_tokens"] == odd.num_label_tokens
        assert trainer.evaluate(odd) == pytest.approx(direct["loss"], rel=1e-6)
        everything = model.evaluate(odd.input_ids, attention_mask=odd.attention_mask, document_ids=odd.document_ids)
        assert everything["num_tokens"] > direct["num_tokens"]


# --- training states and resuming --------------------------------------------------------------------------------

RESUME_STEPS, RESUME_ROWS = 12, 28  # 3 global batches per epoch: the state of step 4 is mid-epoch (epoch 1, batch 1)
SAVED_UNDER = {"fsdp_size": 2, "ep_size": 2}
RESUMED_UNDER = {"tp_size": 2}  # another layout on resume: the same rows, other float reductions
WEIGHT_TOL = 5e-5  # max abs across layouts (tests/rank/test_state.py: straight runs differ by up to 1.4e-5)


def resume_config(out_dir, **overrides) -> TrainerConfig:
    options = dict(
        output_dir=out_dir,
        steps=RESUME_STEPS,
        global_batch_size=BATCH,
        lr=1e-3,
        warmup_steps=2,
        eval_every=4,
        progress=False,
    )
    return TrainerConfig(**(options | overrides))


def records(out_dir) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def hub_weights(directory) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(directory / "model.safetensors")


def max_weight_diff(a, b) -> float:
    assert a.keys() == b.keys()
    return max((a[name] - b[name]).abs().max().item() for name in a)


def test_a_resumed_run_continues_the_straight_one(load_on_world, tiny, tmp_path):
    """12 steps straight vs 6 steps (a state after step 4, so steps 5-6 are lost as in a crash) + a new handle and
    Trainer resuming "latest" for the rest: same metrics step for step, once each, and the same final weights;
    and the same from that state under another layout."""
    import shutil

    train, held_out = ragged_rows(RESUME_ROWS, seed=4), ragged_rows(5, seed=5)
    straight_dir, resumed_dir, moved_dir = tmp_path / "straight", tmp_path / "resumed", tmp_path / "moved"
    with load_on_world(tiny, SAVED_UNDER) as model:
        straight = Trainer(model, train, resume_config(straight_dir), eval_data=held_out).fit()
    with load_on_world(tiny, SAVED_UNDER) as model:
        first = Trainer(model, train, resume_config(resumed_dir, save_state_every=4), eval_data=held_out)
        part = first.fit(num_steps=6)
    assert part.state == resumed_dir / "states" / "step-00000004" and part.resumed_from is None
    assert [r["step"] for r in records(resumed_dir) if "loss" in r] == [1, 2, 3, 4, 5, 6]
    shutil.copytree(resumed_dir, moved_dir)

    def resume(out_dir, layout):
        with load_on_world(tiny, layout) as model:
            config = resume_config(out_dir, save_state_every=4, resume_from="latest")
            trainer = Trainer(model, train, config, eval_data=held_out)
            assert trainer.step == 4 and model.step == 4
            return trainer.fit()

    resumed = resume(resumed_dir, SAVED_UNDER)
    moved = resume(moved_dir, RESUMED_UNDER)
    assert resumed.resumed_from == resumed_dir / "states" / "step-00000004"
    assert resumed.steps == 8 and resumed.eval_loss_before is None  # steps 5-12; no eval "before the first step"
    # keep_last=2: the states of steps 8 and 12 remain
    assert [p.name for p in sorted((resumed_dir / "states").iterdir())] == ["step-00000008", "step-00000012"]
    assert resumed.state == resumed_dir / "states" / "step-00000012"

    expected = records(straight_dir)
    evals = [(r["step"], "loss" in r) for r in expected if "eval_loss" in r]
    assert evals == [(0, False), (4, True), (8, True), (12, True)]  # the evals ride on the steps' records
    for out_dir in (resumed_dir, moved_dir):
        got = records(out_dir)
        # one record per step (the lost steps 5-6 were dropped and made again), the evals of 0, 4, 8 and 12 once
        assert [r["step"] for r in got] == [r["step"] for r in expected] == list(range(RESUME_STEPS + 1))
        for a, b in zip(expected, got, strict=True):
            assert a.get("lr") == b.get("lr") and a.get("num_tokens") == b.get("num_tokens"), (a, b)
            for key in ("loss", "eval_loss"):
                assert (key in a) == (key in b)
                if key in a:
                    assert b[key] == pytest.approx(a[key], rel=1e-6), (out_dir.name, a["step"], key)

    reference = hub_weights(straight.checkpoint)
    assert max_weight_diff(reference, hub_weights(resumed.checkpoint)) <= 1e-6
    assert max_weight_diff(reference, hub_weights(moved.checkpoint)) <= WEIGHT_TOL


def test_an_earlier_run_is_refused_unless_resumed_or_overwritten(load_local, tiny, tmp_path):
    train = ragged_rows(16, seed=6)
    config = dict(steps=2, global_batch_size=BATCH, lr=1e-3, progress=False)
    with load_local(tiny, {}) as model:
        Trainer(model, train, TrainerConfig(output_dir=tmp_path, save_state_every=2, **config)).fit()
    with load_local(tiny, {}) as model:
        with pytest.raises(
            ValueError,
            match=rf"output_dir {re.escape(str(tmp_path))} holds an earlier run \(a non-empty metrics.jsonl, "
            r"a checkpoint/ directory, 1 training state\(s\) in states/, the latest of step 2\).*"
            r"resume_from='latest'.*overwrite=True",
        ):
            Trainer(model, train, TrainerConfig(output_dir=tmp_path, **config))
        with pytest.raises(ValueError, match=r"resume_from='.*absent'.*training state .*absent does not exist"):
            Trainer(model, train, TrainerConfig(output_dir=tmp_path / "new", resume_from=tmp_path / "absent", **config))
        # None of that reached the ranks: the optimizer was never configured.
        with pytest.raises(RuntimeError, match="configure_training"):
            model.train_step(train.input_ids[:2])
        fresh = Trainer(model, train, TrainerConfig(output_dir=tmp_path, overwrite=True, **config))
        assert (tmp_path / "metrics.jsonl").read_text() == "" and not (tmp_path / "states").exists()
        assert fresh.step == 0 and fresh.fit().steps == 2
    assert [r["step"] for r in records(tmp_path)] == [1, 2]
    with pytest.raises(ValueError, match=r"resume_from='latest' and overwrite=True contradict each other"):
        TrainerConfig(output_dir=tmp_path, resume_from="latest", overwrite=True)
    for field, value in [("save_state_every", 0), ("keep_last", 0), ("async_save", 1), ("resume_from", 3)]:
        with pytest.raises(ValueError, match=rf"TrainerConfig: {field}={value!r}"):
            TrainerConfig(output_dir=tmp_path, **{field: value})


def test_keep_last_and_async_save(load_local, tiny, tmp_path):
    """save_state_every=2 over 6 steps with keep_last=2 leaves the states of steps 4 and 6, saved synchronously or
    not; saving asynchronously changes neither the losses nor what the states hold."""
    from raymoe import export_state

    train = ragged_rows(16, seed=7)
    runs = {}
    for async_save in (False, True):
        out_dir = tmp_path / f"async_{async_save}"
        config = TrainerConfig(
            output_dir=out_dir,
            steps=6,
            global_batch_size=BATCH,
            lr=1e-3,
            save_state_every=2,
            keep_last=2,
            async_save=async_save,
            save_at_end=False,
            progress=False,
        )
        with load_local(tiny, {}) as model:
            summary = Trainer(model, train, config).fit()
        assert summary.state == out_dir / "states" / "step-00000006"
        assert sorted(p.name for p in (out_dir / "states").iterdir()) == ["step-00000004", "step-00000006"]
        runs[async_save] = summary
        export_state(summary.state, tmp_path / f"export_{async_save}")
    assert [r["loss"] for r in runs[False].history] == [r["loss"] for r in runs[True].history]
    assert max_weight_diff(hub_weights(tmp_path / "export_False"), hub_weights(tmp_path / "export_True")) == 0.0
    manifests = [json.loads((runs[a].state / "raymoe_state.json").read_text()) for a in (False, True)]
    assert (
        manifests[0]["extra"]
        == manifests[1]["extra"]
        == {
            "trainer": {
                "step": 6,
                "samples_seen": 6 * BATCH,
                "global_batch_size": BATCH,
                "seed": 0,
                "train_rows": 16,
                "steps": 6,
                "data_order": "rows",
            }
        }
    )


def test_resuming_with_another_global_batch_size_fails_before_loading(load_local, tiny, tmp_path):
    train = ragged_rows(16, seed=8)
    config = dict(output_dir=tmp_path, steps=4, lr=1e-3, progress=False, save_at_end=False)
    with load_local(tiny, {}) as model:
        Trainer(model, train, TrainerConfig(global_batch_size=BATCH, save_state_every=2, **config)).fit(num_steps=2)
    with load_local(tiny, {}) as model:
        with pytest.raises(ValueError, match=r"global_batch_size=4 here, but the saved run had global_batch_size=8"):
            Trainer(model, train, TrainerConfig(global_batch_size=4, resume_from="latest", **config))
        with pytest.raises(ValueError, match=r"train_rows=12 here, but the saved run had train_rows=16"):
            Trainer(
                model, train.rows(slice(0, 12)), TrainerConfig(global_batch_size=BATCH, resume_from="latest", **config)
            )
        with pytest.raises(RuntimeError, match="configure_training"):  # nothing was loaded
            model.train_step(train.input_ids[:2])


def test_batches_from_a_given_step_are_the_straight_runs():
    """``batch_indices(start=b)`` computes batch b's epoch and offset: the same rows as drawing b batches first."""
    from itertools import islice

    from raymoe.driver.batch_order import batch_indices

    straight = list(islice(batch_indices(28, 8, seed=3), 10))  # 3 batches per epoch, the tail of 4 dropped
    for start in (0, 1, 3, 4, 7):
        resumed = list(islice(batch_indices(28, 8, seed=3, start=start), 10 - start))
        assert all(torch.equal(a, b) for a, b in zip(straight[start:], resumed, strict=True)), start


def test_metrics_log_resumes_through_a_step(tmp_path):
    """A resumed log keeps the records up to its step (train and eval), drops later ones and a line cut short by a
    crash, and appends; a fresh log empties the file."""
    from raymoe.driver.metrics import MetricsLog, read_metrics

    path = tmp_path / "metrics.jsonl"
    lines = [{"step": 0, "eval_loss": 5.0}, *({"step": s, "loss": 5.0 - s} for s in (1, 2, 3))]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"step": 4, "lo')
    log = MetricsLog(path, keep_through_step=2)
    assert log.records == lines[:3] == read_metrics(path)
    log.append({"step": 3, "loss": 1.5})
    assert read_metrics(path) == [*lines[:3], {"step": 3, "loss": 1.5}]
    path.write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl line 2 is not a JSON record"):
        MetricsLog(path, keep_through_step=2)
    assert MetricsLog(path).records == [] and path.read_text() == ""
    assert MetricsLog(tmp_path / "absent.jsonl", keep_through_step=3).records == []


def test_a_lora_run_saves_its_adapter_and_the_merged_checkpoint_only_when_asked(load_local, tiny, tmp_path):
    """save_adapter: output_dir/adapter (PEFT files and the tokenizer) at save_every and the end, and no checkpoint/
    without save_checkpoint; adapter/ is an earlier run's; overwrite removes what the new run does not save."""
    from raymoe.driver.tiny import tiny_tokenizer

    train = ragged_rows(16, seed=9)
    lora = raymoe.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"], target_parameters=["mlp.experts.down_proj"])
    options = dict(output_dir=tmp_path, steps=2, global_batch_size=BATCH, lr=1e-3, progress=False)
    adapter = tmp_path / "adapter"
    with load_local(tiny, {}, lora=lora) as model:
        assert model.lora is not None and model.lora.r == 2
        config = TrainerConfig(save_adapter=True, save_checkpoint=False, save_every=1, **options)
        summary = Trainer(model, train, config, tokenizer=tiny_tokenizer()).fit()
        assert summary.adapter == adapter and summary.checkpoint is None and not (tmp_path / "checkpoint").exists()
        assert {p.name for p in adapter.iterdir()} >= {"adapter_config.json", "adapter_model.safetensors"}
        assert (adapter / "tokenizer.json").is_file()
        with pytest.raises(
            ValueError, match=r"holds an earlier run \(a non-empty metrics.jsonl, an adapter/ directory"
        ):
            Trainer(model, train, TrainerConfig(save_adapter=True, **options))
        # the merged checkpoint alone, over the earlier run: its adapter/ goes (this run would leave it stale)
        merged = Trainer(model, train, TrainerConfig(overwrite=True, **options)).fit()
        assert not adapter.exists() and merged.adapter is None
        assert (merged.checkpoint / "model.safetensors").is_file() and not any(
            "lora" in k for k in hub_weights(merged.checkpoint)
        )
    with load_local(tiny, {}) as model:
        assert model.lora is None
        with pytest.raises(ValueError, match=r"save_adapter=True, but the model has no LoRA adapters"):
            Trainer(model, train, TrainerConfig(save_adapter=True, output_dir=tmp_path / "full", steps=2))
