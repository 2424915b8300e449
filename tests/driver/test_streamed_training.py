"""Training on rows that stay in Ray's object store (``load_dataset(engine="ray")``) on a local Ray: each
data-parallel batch's ranks read their rows there, and the steps equal the same rows sent from the driver; the
Trainer evaluates and resumes mid-epoch on another layout, each sample seen once, as the straight run."""

from __future__ import annotations

import json

import pytest
import torch

import raymoe
from raymoe import Trainer, TrainerConfig
from raymoe.driver.tiny import tiny_tokenizer

SEQ, BATCH, WINDOW = 64, 4, 12
STEPS = 10  # 40 rows seen; the state of step 4 is mid-epoch


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return raymoe.build_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def chat(ray_session, tmp_path_factory):
    """80 conversations packed by the Ray engine (windows of 12: 7 blocks), and the same rows collected here."""
    records = [
        {
            "messages": [
                {"role": "user", "content": "q" * (i * 7 % 23 + 1)},
                {"role": "assistant", "content": "a" * (i % 9 + 1)},
            ]
        }
        for i in range(80)
    ]
    path = tmp_path_factory.mktemp("chat") / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    streamed = raymoe.load_dataset(path, SEQ, tiny_tokenizer(), engine="ray", pack_window=WINDOW)
    assert isinstance(streamed, raymoe.StreamedData) and len(streamed.blocks) > 2
    return streamed, streamed.collect()


def test_steps_on_the_object_stores_rows_equal_the_same_rows_from_the_driver(load_on_world, tiny, chat):
    streamed, collected = chat
    order = [torch.randperm(streamed.num_sequences, generator=torch.Generator().manual_seed(s))[:6] for s in range(3)]
    layout = {"fsdp_size": 2}

    def run(step):
        with load_on_world(tiny, layout) as model:
            model.configure_training(lr=1e-2, balance="none")
            out = [step(model, indices) for indices in order]
            return out, model.evaluate_streamed(streamed.batch(torch.arange(5), 2))["loss"]

    def from_driver(model, indices):
        rows = collected.rows(indices)
        return model.train_step(rows.input_ids, labels=rows.labels, attention_mask=rows.attention_mask,
                                micro_batches=2, document_ids=rows.document_ids)  # fmt: skip

    def from_store(model, indices):
        return model.train_step_streamed(streamed.batch(indices, 2), micro_batches=2)

    (driver, driver_eval), (store, store_eval) = run(from_driver), run(from_store)
    for a, b in zip(driver, store, strict=True):
        assert a["num_tokens"] == b["num_tokens"]
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
    assert store_eval == pytest.approx(driver_eval, rel=1e-6)


def _config(out_dir, **overrides) -> TrainerConfig:
    options = dict(output_dir=out_dir, steps=STEPS, global_batch_size=BATCH, lr=1e-3, warmup_steps=2,
                   save_at_end=False, progress=False, eval_every=4, keep_last=3)  # fmt: skip
    return TrainerConfig(**{**options, **overrides})


def _losses(out_dir) -> list[tuple[int, float]]:
    records = map(json.loads, (out_dir / "metrics.jsonl").read_text().splitlines())
    return [(r["step"], r["loss"]) for r in records if "loss" in r]


def test_a_run_resumed_mid_epoch_on_another_layout_continues_the_straight_one(load_on_world, tiny, chat, tmp_path):
    streamed, _ = chat
    train, held_out = streamed.split(0.1)
    with load_on_world(tiny, {"fsdp_size": 2}) as model:
        trainer = Trainer(model, train, _config(tmp_path / "straight"), eval_data=held_out)
        straight = trainer.fit()
        # evaluation reads the object store's rows: the same loss as the held-out rows sent from the driver
        assert trainer.evaluate(held_out) == pytest.approx(trainer.evaluate(held_out.collect()), rel=1e-6)
    with load_on_world(tiny, {"fsdp_size": 2}) as model:
        Trainer(model, train, _config(tmp_path / "resumed", save_state_every=4), eval_data=held_out).fit(6)
    with load_on_world(tiny, {"tp_size": 2}) as model:
        config = _config(tmp_path / "resumed", save_state_every=4, resume_from="latest")
        with pytest.raises(ValueError, match=r"data_order=rows here, but the saved run had data_order=blocks:"):
            Trainer(model, train.collect(), config)  # the same rows from the driver: another order, refused
        resumed = Trainer(model, train, config, eval_data=held_out)
        assert resumed.step == 4
        resumed.fit()
    expected, got = _losses(tmp_path / "straight"), _losses(tmp_path / "resumed")
    assert [s for s, _ in got] == [s for s, _ in expected] == list(range(1, STEPS + 1))
    for (step, a), (_, b) in zip(expected, got, strict=True):
        assert b == pytest.approx(a, rel=1e-5), step
    assert straight.eval_loss_after is not None
