"""examples/generate.py in this process on the session's local Ray: one prompt streams the same tokens that a batch
of prompts gives, and bad input is one error line before any rank call."""

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
def test_streamed_prompt_equals_its_row_of_a_batch(ray_session, generate_script, tmp_path, capsys):
    common = ["--max-new-tokens", "12", "--fsdp-size", "2", "--ep-size", "2", "--output-dir", str(tmp_path)]
    common += ["--do-sample", "--temperature", "0.8", "--seed", "3", "--cpus-per-rank", "0.5"]
    [streamed] = generate_script.run(generate_script.parse_args(["--prompt", "The river ", *common]))
    assert capsys.readouterr().out.startswith("The river ") and len(streamed) == len(b"The river ") + 12
    batch = generate_script.run(generate_script.parse_args(["--prompt", "The river ", "--prompt", "A", *common]))
    assert batch[0] == streamed  # row 0 of the batch: the same global row, the same sampling numbers
    assert batch[1][:1] == list(b"A")


def test_an_empty_prompt_is_one_error_line(ray_session, generate_script, tmp_path, capsys):
    argv = ["--prompt", "", "--fsdp-size", "2", "--output-dir", str(tmp_path), "--cpus-per-rank", "0.5"]
    assert generate_script.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["generate.py: error: prompt 0 is empty: every prompt needs a token"]
