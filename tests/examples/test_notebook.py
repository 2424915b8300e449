"""examples/interactive.ipynb runs headless, top to bottom, in a kernel of this venv's Python, and frees its actors."""

from __future__ import annotations

import shutil
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
NOTEBOOK = EXAMPLES / "interactive.ipynb"


@pytest.mark.slow
def test_notebook_runs_every_cell_and_shuts_down(ray_session, ray_tables, monkeypatch, tmp_path):
    before = ray_tables.rank_actors()
    # The kernel joins the session's Ray through RAY_ADDRESS, so its rank actors are visible here.
    monkeypatch.setenv("RAY_ADDRESS", ray_session.get_runtime_context().gcs_address)
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    # Run where Jupyter would (next to the notebook, reading data/), but in a copy: its runs/ stays out of the repo.
    shutil.copytree(EXAMPLES / "data", tmp_path / "data")
    # The python3 kernel of the running interpreter (ipykernel's native spec).
    client = NotebookClient(
        notebook, kernel_name="python3", timeout=300, resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()

    code_cells = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert all(cell.execution_count is not None for cell in code_cells)
    assert not [o for cell in code_cells for o in cell.outputs if o.output_type == "error"]
    text = "\n".join(
        o.get("text", "") + o.get("data", {}).get("text/plain", "") for cell in code_cells for o in cell.outputs
    )
    assert "one batch per TP pair" in text and "ep_size=2   E0-3   E4-7" in text  # the topology picture
    assert "ep_dispatch_experts" in text  # the plans
    assert "train: 100%" in text  # the progress bar of the first fit
    assert "eval loss after 12 steps" in text
    assert "model.safetensors" in text and "tokenizer.json" in text
    assert "shut down" in text
    assert ray_tables.rank_actors() == before
