"""The handle and the Trainer on one rank in the test's own process (``LocalRankGroup``, no Ray): the same code
paths as on a Ray world, fast enough for ``make test-fast``. Multi-rank behaviour is tested on Ray elsewhere."""

from __future__ import annotations

import json

import pytest
import torch

import raymoe
from raymoe import DistributedConfig, DistributedModel, PackedData, Trainer, TrainerConfig
from raymoe.driver.training_data import rows_of
from raymoe.rank.local import LocalRankError, LocalRankGroup
from raymoe.spec.launch import prepare_launch

STEPS, BATCH, SEQ = 8, 4, 16


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return raymoe.build_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


def rows(num_rows: int = 16, seed: int = 3) -> PackedData:
    return PackedData.from_rows(torch.randint(0, 256, (num_rows, SEQ), generator=torch.Generator().manual_seed(seed)))


def config(out, **kw) -> TrainerConfig:
    options = dict(steps=STEPS, global_batch_size=BATCH, lr=1e-3, warmup_steps=1, save_state_every=2,
                   save_at_end=False, progress=False)  # fmt: skip
    return TrainerConfig(output_dir=out, **{**options, **kw})


def losses(path) -> list[float]:
    return [r["loss"] for r in map(json.loads, path.read_text().splitlines()) if "loss" in r]


def test_a_local_world_computes_what_one_process_does(load_local, tiny):
    ids = torch.randint(0, 256, (4, 12), generator=torch.Generator().manual_seed(0))
    reference = raymoe.load_model(tiny)
    with torch.no_grad():
        expected = reference(ids)
    with load_local(tiny) as model:
        assert (model(ids) - expected).abs().max().item() <= 1e-5
        assert (model(ids, return_logits="last") - expected[:, -1]).abs().max().item() <= 1e-5
        assert model.generate([[5, 6, 7]], max_new_tokens=3)[0][:3] == [5, 6, 7]
        with pytest.raises(ValueError, match=r"generate: unknown option\(s\) temprature; the options are do_sample"):
            model.generate([[5, 6, 7]], 3, temprature=0.5)
        model.configure_training(lr=1e-3, balance="none")
        one = model.train_step(ids)
        evaluated = model.evaluate(ids)
    with load_local(tiny) as model:  # the same step as two micro-batches: the same loss, norm and weights after
        model.configure_training(lr=1e-3, balance="none")
        two = model.train_step(ids, micro_batches=2)
        assert two["loss"] == pytest.approx(one["loss"], rel=1e-6)
        assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5)
        assert model.evaluate(ids)["loss"] == pytest.approx(evaluated["loss"], rel=1e-5)
        assert model.step == 1


def test_a_tied_head_loads_on_a_rank_without_fsdp(load_local, tiny_checkpoint, load_hf_model, tmp_path):
    """A tied checkpoint stores the embedding only: the rank's head must be that parameter again after its
    parameters get storage (``to_empty`` gives each its own), or it asks the checkpoint for ``lm_head.weight``."""
    checkpoint = tiny_checkpoint("llama_mha_tied_linear_rope")
    ids = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(0))
    with load_local(checkpoint) as model:
        with torch.no_grad():
            assert (model(ids) - load_hf_model(checkpoint)(input_ids=ids).logits).abs().max().item() <= 1e-5
        model.configure_training(lr=1e-2)
        model.train_step(ids)
        model.save_pretrained(tmp_path)
    trained = load_hf_model(tmp_path)
    assert torch.equal(trained.lm_head.weight, trained.model.embed_tokens.weight)


def count_adamw(monkeypatch) -> list[int]:
    """How many AdamW optimizers the (in-process) rank builds from now on."""
    built: list[int] = []
    original = torch.optim.AdamW.__init__

    def counted(self, *args, **kwargs):
        built.append(1)
        original(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "__init__", counted)
    return built


def test_a_resumed_run_builds_its_optimizer_once_and_continues_the_straight_one(
    load_local, tiny, tmp_path, monkeypatch
):
    with load_local(tiny) as model:
        straight = Trainer(model, rows(), config(tmp_path / "straight")).fit()
    with load_local(tiny) as model:
        Trainer(model, rows(), config(tmp_path / "resumed")).fit(num_steps=5)  # a state after step 4
    built = count_adamw(monkeypatch)
    with load_local(tiny) as model:
        trainer = Trainer(model, rows(), config(tmp_path / "resumed", resume_from="latest"))
        assert built == [1] and trainer.step == model.step == 4  # load_state alone: no AdamW built to be replaced
        resumed = trainer.fit()
    assert resumed.steps == 4 and resumed.last_loss == pytest.approx(straight.last_loss, rel=1e-6)
    assert losses(tmp_path / "resumed" / "metrics.jsonl") == pytest.approx(losses(straight.metrics_file), rel=1e-6)


def owned_local_model(checkpoint) -> DistributedModel:
    """A model that owns its local world (restart() starts a new one), as from_pretrained owns its Ray ranks."""
    return DistributedModel.launch(prepare_launch(checkpoint, DistributedConfig()), LocalRankGroup(), owns_group=True)


def test_the_failure_policy_restarts_from_the_newest_state(tiny, tmp_path, fail_at_forward):
    """A rank failure in step 5 (states after 2 and 4): new ranks, state 4 reloaded, steps 5-8 again; the run
    equals an uninterrupted one and records the restart once, naming the rank where it began."""
    with owned_local_model(tiny) as model:
        straight = Trainer(model, rows(), config(tmp_path / "straight")).fit()
    with owned_local_model(tiny) as model:
        trainer = Trainer(model, rows(), config(tmp_path / "failed", max_failures=1))
        model.run_on_ranks(fail_at_forward, 5)
        summary = trainer.fit()
        assert model.is_alive
    assert summary.restarts == 1 and summary.last_loss == pytest.approx(straight.last_loss, rel=1e-6)
    records = [json.loads(line) for line in (tmp_path / "failed" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == list(range(1, STEPS + 1))
    (restart,) = [r for r in records if "restart" in r]
    assert restart["step"] == 4 and restart["failed_at_step"] == 5 and restart["resumed_from"].endswith("step-00000004")
    assert restart["cause"] == "LocalRankError: rank 0 failed in train_step: RuntimeError: injected failure"


def test_without_restarts_the_failure_is_raised_as_it_is_and_a_live_model_is_not_restarted(
    tiny, tmp_path, fail_at_forward
):
    with owned_local_model(tiny) as model:
        trainer = Trainer(model, rows(), config(tmp_path / "none"))
        model.run_on_ranks(fail_at_forward, 3)
        with pytest.raises(LocalRankError, match="injected failure"):
            trainer.fit()
        assert not model.is_alive
    with owned_local_model(tiny) as model:  # a bad batch fails on the driver: the ranks live, nothing restarts
        trainer = Trainer(model, rows(), config(tmp_path / "alive", max_failures=3))
        trainer.train_data = rows_of(PackedData.from_rows(torch.full((16, SEQ), 999)))
        with pytest.raises(ValueError, match=r"input_ids must be token ids in \[0, 264\)"):
            trainer.fit()
        assert model.is_alive and trainer.restarts == 0


def test_one_failure_too_many_names_the_newest_state(tiny, tmp_path, fail_at_forward):
    with owned_local_model(tiny) as model:
        trainer = Trainer(model, rows(), config(tmp_path, max_failures=1))
        model.run_on_ranks(fail_at_forward, 5)
        restart = model.restart

        def restart_and_fail_again():
            restart()
            model.run_on_ranks(fail_at_forward, 2)

        model.restart = restart_and_fail_again
        with pytest.raises(raymoe.TrainingFailed, match=r"failed again after 1 restart\(s\) \(max_failures=1\)") as err:
            trainer.fit()
    assert err.value.state == tmp_path / "states" / "step-00000004"
    assert err.value.cause == "LocalRankError: rank 0 failed in train_step: RuntimeError: injected failure"


@pytest.mark.parametrize(
    ("option", "shown"),
    [({"cpus_per_rank": 2}, "cpus_per_rank=2"), ({"collective_timeout_s": 30, "use_gpu": False}, "use_gpu=False")],
)
def test_placement_options_with_a_world_are_one_error_and_the_world_stays(load_local, tiny, option, shown):
    """The world's ranks run already: a placement option given to from_pretrained would change nothing."""
    with pytest.raises(ValueError, match=rf"from_pretrained\(world=\.\.\.\) .*{shown}.*give them to start_world"):
        load_local(tiny, **option)
    with load_local(tiny) as model:  # the same world, untouched, loads the model
        assert model(torch.tensor([[1, 2, 3]])).shape == (1, 3, model.model_config.vocab_size)


def test_compiling_is_reported_where_it_happens_and_left_out_of_the_throughput(load_local, tiny, tmp_path, capsys):
    """A compiled model's first step and first evaluation of a batch shape compile the decoder blocks (dynamo and AOT
    autograd: ``aot_eager``); they say so in the progress output and in their records, later ones of that shape
    compile nothing, and the summary's throughput leaves the compiling out."""
    held_out = rows(6, seed=4)
    with load_local(tiny, compile="aot_eager") as model:
        summary = Trainer(model, rows(), config(tmp_path, steps=3, progress=True), eval_data=held_out).fit()
        again = model.evaluate(held_out.input_ids[:BATCH])
    said = capsys.readouterr().err
    evaluation, *steps = summary.history
    assert evaluation["step"] == 0 and evaluation["eval_compile_s"] > 0
    assert steps[0]["compile_s"] > 0 and all("compile_s" not in r for r in steps[1:])
    assert "eval_compile_s" not in steps[-1]  # the evaluation after the last step: the shape compiled before
    assert "compile_s" not in again
    assert summary.compile_s == steps[0]["compile_s"] and summary.eval_compile_s == evaluation["eval_compile_s"]
    assert summary.compile_s < steps[0]["step_time_s"]
    assert summary.tokens_per_s == pytest.approx(summary.num_tokens / (summary.train_time_s - summary.compile_s))
    assert "the evaluation before training: compiled the decoder blocks in " in said
    assert "step 1: compiled the decoder blocks in " in said
    assert "step 2: compiled" not in said and "after step 3: compiled" not in said
