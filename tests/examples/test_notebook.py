"""examples/interactive.ipynb runs headless, top to bottom, in a kernel of this venv's Python, and frees its actors."""

from __future__ import annotations

import shutil
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from ray.util.state import list_actors

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
NOTEBOOK = EXAMPLES / "interactive.ipynb"


def rank_actors_alive(ray) -> set:
    """Ids of the RankActors alive in the session's cluster (named explicitly: other Ray instances may run on this
    machine); the session's shared worlds are among them when a test started them."""
    address = ray.get_runtime_context().gcs_address
    alive = list_actors(address=address, filters=[("state", "=", "ALIVE")])
    return {a.actor_id for a in alive if a.class_name == "RankActor"}


@pytest.mark.slow
def test_notebook_runs_every_cell_and_shuts_down(ray_session, monkeypatch, tmp_path):
    before = rank_actors_alive(ray_session)
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
    assert rank_actors_alive(ray_session) == before
