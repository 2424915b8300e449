"""examples/generate.py in this process on the session's local Ray: one prompt streams the same tokens that a batch
of prompts gives, and bad input is one error line before any rank starts."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "generate.py"


@pytest.fixture(scope="module")
def generate_script():
    spec = importlib.util.spec_from_file_location("raymoe_example_generate", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_streamed_prompt_equals_its_row_of_a_batch(ray_session, world, generate_script, tmp_path, capsys):
    """The prompt streamed on the script's own ranks, then in a batch on the session's world of the same size."""
    common = ["--max-new-tokens", "12", "--fsdp-size", "2", "--ep-size", "2", "--output-dir", str(tmp_path)]
    common += ["--do-sample", "--temperature", "0.8", "--seed", "3", "--cpus-per-rank", "0.5"]
    [streamed] = generate_script.run(generate_script.parse_args(["--prompt", "The river ", *common]))
    assert capsys.readouterr().out.startswith("The river ") and len(streamed) == len(b"The river ") + 12
    both = generate_script.parse_args(["--prompt", "The river ", "--prompt", "A", *common])
    batch = generate_script.run(both, world(2))
    assert batch[0] == streamed  # row 0 of the batch: the same global row, the same sampling numbers
    assert batch[1][:1] == list(b"A")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--prompt", ""], "prompt 0 is empty: every prompt needs a token"),
        (["--prompt", "a", "--do-sample", "--top-p", "2"], "top_p=2.0 must be in (0, 1]"),
    ],
    ids=["empty-prompt", "top-p"],
)
def test_bad_input_is_one_error_line_before_any_rank_starts(
    ray_tables, generate_script, tmp_path, capsys, args, message
):
    before = ray_tables.rank_actors(state=None)  # any state: one started and stopped shows too
    argv = [*args, "--fsdp-size", "2", "--output-dir", str(tmp_path), "--cpus-per-rank", "0.5"]
    assert generate_script.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"generate.py: error: {message}"]
    assert ray_tables.rank_actors(state=None) == before  # no rank was started (and stopped) for it
