"""A run's output directory: what an earlier run left is refused unless resumed or overwritten; pruning."""

import json

import pytest

from raymoe.checkpoint.training_state import MANIFEST_FILE
from raymoe.driver.run_directory import RunDirectory


def fake_state(root, step):
    """A directory the state listing counts as complete (its manifest is written last)."""
    path = root / "states" / f"step-{step:08d}"
    path.mkdir(parents=True)
    (path / MANIFEST_FILE).write_text(json.dumps({"step": step}))
    return path


def test_an_empty_or_absent_directory_starts_at_step_zero(tmp_path):
    run = RunDirectory(tmp_path / "new")
    assert run.earlier_run() == [] and run.start_point(None, overwrite=False) is None
    assert run.start_point("latest", overwrite=False) is None and run.latest_state() is None
    assert run.root.is_absolute()


def test_an_earlier_run_is_named_and_refused(tmp_path):
    run = RunDirectory(tmp_path)
    run.metrics.write_text('{"step": 1}\n')
    run.checkpoint.mkdir()
    run.adapter.mkdir()
    fake_state(tmp_path, 2)
    held = run.earlier_run()
    assert held == ["a non-empty metrics.jsonl", "a checkpoint/ directory", "an adapter/ directory",
                    "1 training state(s) in states/, the latest of step 2"]  # fmt: skip
    with pytest.raises(ValueError, match=r"holds an earlier run .* resume_from='latest'"):
        run.start_point(None, overwrite=False)
    assert run.start_point(None, overwrite=True) is None
    run.clear_unsaved(checkpoint=True, adapter=False)  # a run that saves the checkpoint only: the adapter goes
    assert run.checkpoint.is_dir() and not run.adapter.exists()
    run.clear_unsaved(checkpoint=False, adapter=True)
    assert not run.checkpoint.exists()


def test_keep_last_prunes_older_states_but_never_the_one_written(tmp_path):
    run = RunDirectory(tmp_path)
    states = [fake_state(tmp_path, step) for step in (2, 4, 6)]
    run.after_state_save(2, written=states[-1])
    assert sorted(p.name for p in run.states.iterdir()) == ["step-00000004", "step-00000006"]
    run.after_state_save(None, written=states[-1])  # None keeps all
    assert len(list(run.states.iterdir())) == 2
    run.clear_states()
    assert not run.states.exists()
