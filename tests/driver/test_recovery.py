"""Trainer(max_failures=N): a rank process killed (SIGKILL) or frozen (SIGSTOP) mid-run is replaced, the newest state
reloaded, and the run finishes with the losses of an uninterrupted one; one failure too many is a clear error.

Failures are real: a forward hook inside rank 1's process kills or stops that process at its ``at``-th forward.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys

import pytest
import torch
from ray import cloudpickle

import raymoe
from raymoe import DistributedConfig, PackedData, Trainer, TrainerConfig

cloudpickle.register_pickle_by_value(sys.modules[__name__])

STEPS, BATCH, SEQ = 12, 4, 16
LAYOUT = {"fsdp_size": 2}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return raymoe.build_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


def data() -> PackedData:
    return PackedData.from_rows(torch.randint(0, 256, (16, SEQ), generator=torch.Generator().manual_seed(3)))


def config(out, **kw) -> TrainerConfig:
    return TrainerConfig(
        output_dir=out, steps=STEPS, global_batch_size=BATCH, lr=1e-3, warmup_steps=1, save_state_every=4,
        save_at_end=False, progress=False, **kw,
    )  # fmt: skip


def fail_rank_one_at_forward(ctx, at: int, how: str) -> None:
    """Rank 1's process ends (SIGKILL) or stops (SIGSTOP) when its ``at``-th forward starts."""
    if ctx.rank != 1:
        return
    seen = []

    def hook(*_):
        seen.append(1)
        if len(seen) == at:
            os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGSTOP)

    ctx.require_model().model.register_forward_pre_hook(hook)


def losses(path) -> list[float]:
    return [r["loss"] for r in map(json.loads, path.read_text().splitlines()) if "loss" in r]


@pytest.fixture(scope="module")
def uninterrupted(load_on_world, tiny, tmp_path_factory):
    with load_on_world(tiny, LAYOUT) as model:
        return Trainer(model, data(), config(tmp_path_factory.mktemp("straight"))).fit()


@pytest.mark.parametrize("how", ["kill", "freeze"])
def test_a_failed_rank_is_replaced_and_the_run_equals_an_uninterrupted_one(
    ray_session, tiny, uninterrupted, tmp_path, how
):
    model = raymoe.from_pretrained(
        tiny, distributed_config=DistributedConfig(**LAYOUT), cpus_per_rank=0.25, collective_timeout_s=10
    )
    try:
        trainer = Trainer(model, data(), config(tmp_path, max_failures=1))
        model.run_on_ranks(fail_rank_one_at_forward, 7, how)  # in step 7: after the state of step 4
        summary = trainer.fit()
    finally:
        model.shutdown()
    assert summary.steps == STEPS and summary.restarts == 1
    assert summary.last_loss == pytest.approx(uninterrupted.last_loss, rel=1e-6)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == list(range(1, STEPS + 1))  # each step once
    assert losses(tmp_path / "metrics.jsonl") == pytest.approx(losses(uninterrupted.metrics_file), rel=1e-6)
    (restart,) = [r for r in records if "restart" in r]
    assert restart["step"] == 4 and restart["failed_at_step"] == 7 and restart["resumed_from"].endswith("step-00000004")
    if how == "kill":  # the dead rank is named first, never the survivor whose collective lost its peer
        assert restart["cause"].startswith("RankError: rank 1 (") and " died in train_step: " in restart["cause"]
    else:
        assert "rank 1 (" in restart["cause"] and "stopped responding" in restart["cause"]
    assert math.isfinite(restart["time_lost_s"]) and restart["time_lost_s"] > 0
    print(f"{how}: recovered, {restart['time_lost_s']:.1f} s from the failure to the next finished step")


def test_one_failure_too_many_is_a_clear_error_and_the_state_stays(ray_session, tiny, tmp_path):
    model = raymoe.from_pretrained(tiny, distributed_config=DistributedConfig(**LAYOUT), cpus_per_rank=0.25)
    try:
        trainer = Trainer(model, data(), config(tmp_path, max_failures=1))
        model.run_on_ranks(fail_rank_one_at_forward, 6, "kill")
        restart = model.restart

        def restart_and_fail_again():  # the new ranks fail too, two steps after the state they resume from
            restart()
            model.run_on_ranks(fail_rank_one_at_forward, 2, "kill")

        model.restart = restart_and_fail_again
        with pytest.raises(
            RuntimeError, match=r"training failed again after 1 restart\(s\) \(max_failures=1\)"
        ) as caught:
            trainer.fit()
    finally:
        model.shutdown()
    assert "step-00000004: resume from it with resume_from='latest'" in str(caught.value)
    assert caught.value.state == tmp_path / "states" / "step-00000004"
    assert sorted(p.name for p in (tmp_path / "states").iterdir() if not p.name.startswith(".")) == ["step-00000004"]
