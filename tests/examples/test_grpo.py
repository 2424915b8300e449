"""examples/grpo.py in this process on the session's local Ray: the reward rises over a short run (router replay,
PPO's clipped loss on 4 ranks), the records, the plot and the model are written, and bad input is one error line."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "grpo.py"


@pytest.fixture(scope="module")
def grpo_script():
    spec = importlib.util.spec_from_file_location("raymoe_example_grpo", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_the_reward_rises(world, grpo_script, tmp_path):
    """20 steps at a high learning rate (the example's default is 150 at 2e-3): the reward of the first 5 steps is
    ~0.005, of the last 5 ~0.24 (seed 0); each step is ~0.5 s here, on the session's world of 4 (the default
    layout's), not on ranks of its own (a start of ~8 s)."""
    args = grpo_script.parse_args(["--steps", "20", "--lr", "8e-3", "--output-dir", str(tmp_path), "--no-progress"])
    records = grpo_script.run(args, world(4))
    first = sum(r["reward_mean"] for r in records[:5]) / 5
    last = sum(r["reward_mean"] for r in records[-5:]) / 5
    assert first < 0.05 and last > first + 0.1, (first, last)
    written = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in written] == list(range(1, 21))
    assert all(0.0 <= r["clip_fraction"] <= 1.0 and r["grad_norm"] >= 0 for r in written)
    assert sum(r["grad_norm"] > 0 for r in written) > 15  # a step is 0 only when every group scored evenly
    assert (tmp_path / "metrics.png").stat().st_size > 0 and (tmp_path / "checkpoint" / "config.json").is_file()


def test_a_bad_layout_is_one_error_line(ray_session, grpo_script, tmp_path, capsys):
    argv = ["--layout", "tp_size=3", "--output-dir", str(tmp_path), "--steps", "1"]
    assert grpo_script.main(argv) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("grpo.py: error: ")
    assert not (tmp_path / "metrics.jsonl").exists()


def test_the_group_advantages_are_normalised_per_group(grpo_script):
    advantages = grpo_script.group_advantages([0.0, 1.0, 0.5, 0.5], 2)
    assert advantages[0] == pytest.approx(-advantages[1]) and advantages[0] < 0
    assert advantages[2:] == [0.0, 0.0]  # a group whose completions all scored the same teaches nothing
