"""load_state reads in place: its peak memory stays within 1.1 x the training state the model holds (issue 36).

One rank in the test's own process (``load_local``: a ``LocalRankGroup``, no Ray), so torch's profiler sees the
rank's allocations. The tiny Qwen3-MoE's largest tensor (an expert ``gate_up`` block, [8, 128, 96] float32) is
7.8 % of its state; DCP reading one saved chunk at a time stays under the bound, a second copy of the state
(what ``load_state`` used to read into) or two staged chunks at once do not.

Also here: the tensors read into are the very ones the model and its optimizer hold, and a read that fails
after DCP's first copy ends the rank group instead of leaving a half-loaded model that trains on.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

import raymoe
from raymoe.checkpoint.training_state import TrainingStateError
from raymoe.rank.local import LocalRankError

BOUND = 1.1


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return raymoe.build_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


def batch(seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(seed))


# --- on the rank ----------------------------------------------------------------------------------


def _held(ctx) -> list[torch.Tensor]:
    """The local tensors of the state the rank holds: parameters and buffers, AdamW moments and step counters."""
    from torch.distributed.tensor import DTensor

    loaded = ctx.require_model()
    tensors = [value for part in loaded.parts for value in part.state_dict(keep_vars=True).values()]
    if loaded.training is not None:
        tensors += [v for moments in loaded.training.optimizer.state.values() for v in moments.values()]
    return [t.to_local() if isinstance(t, DTensor) else t for t in tensors if isinstance(t, torch.Tensor)]


def state_bytes(ctx) -> int:
    """Bytes of the state's storages, each counted once (a tied weight is one storage)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in _held(ctx)}
    return sum(storages.values())


def storages(ctx) -> dict[int, bytes]:
    """Every held storage's address and its bytes (values, not tensor objects: the comparison is by place)."""
    return {t.untyped_storage().data_ptr(): t.detach().cpu().numpy().tobytes() for t in _held(ctx)}


# --- on the driver --------------------------------------------------------------------------------


@pytest.mark.parametrize("resumed", ["after_a_step", "into_a_fresh_handle"])
def test_load_state_peaks_within_the_state_it_holds(load_local, tiny, tmp_path, resumed, peak_of):
    """Peak of ``load_state`` = the state bytes held before it + the most it held beyond what was live at its
    start (the ``peak_of`` fixture); it must stay within 1.1 x the state bytes held after it (parameters, AdamW moments,
    step counters). ``into_a_fresh_handle`` (no optimizer yet) makes the moments during the load: once, in place."""
    model = load_local(tiny)
    model.configure_training(lr=1e-3)
    model.train_step(batch(seed=1))
    model.save_state(tmp_path / "state")
    if resumed == "into_a_fresh_handle":
        model.shutdown()
        model = load_local(tiny)
    before = model.run_on_ranks(state_bytes)[0]

    beyond = peak_of(lambda: model.load_state(tmp_path / "state"))

    after = model.run_on_ranks(state_bytes)[0]
    load_peak = before + beyond
    assert after == pytest.approx(3 * before if resumed == "into_a_fresh_handle" else before, rel=1e-3)
    assert load_peak <= BOUND * after, (
        f"load_state peaked at {load_peak} bytes ({load_peak / after:.3f} x the {after} state bytes it holds; "
        f"{beyond} bytes beyond those live at its start)"
    )
    assert np.isfinite(model.train_step(batch(seed=2))["loss"])


def test_load_state_reads_into_the_tensors_the_model_and_its_optimizer_hold(load_local, tiny, tmp_path):
    """After a save and another step, load_state puts the saved values back into the same storages: nothing is
    allocated for the state and swapped in."""
    model = load_local(tiny)
    model.configure_training(lr=1e-3)
    model.train_step(batch(seed=1))
    model.save_state(tmp_path / "state")
    saved = model.run_on_ranks(storages)[0]
    model.train_step(batch(seed=2))
    assert model.run_on_ranks(storages)[0] != saved  # the step changed the values in the same places
    model.load_state(tmp_path / "state")
    loaded = model.run_on_ranks(storages)[0]
    assert loaded.keys() == saved.keys()
    assert all(loaded[place] == saved[place] for place in saved)


def _corrupt(state: Path, keys) -> None:
    """Zero the saved bytes of the chunks whose entry is in ``keys`` (the files keep their length, so the driver's
    checks pass and the read itself fails)."""
    metadata = FileSystemReader(state).read_metadata()
    for index, info in metadata.storage_data.items():
        if index.fqn in keys:
            with open(state / info.relative_path, "r+b") as file:
                file.seek(info.offset)
                file.write(bytes(info.length))


def test_a_read_failing_before_any_copy_changes_nothing(load_local, tiny, tmp_path):
    model = load_local(tiny)
    model.configure_training(lr=1e-3)
    model.train_step(batch(seed=1))
    model.save_state(tmp_path / "state")
    model.train_step(batch(seed=2))
    held = model.run_on_ranks(storages)[0]
    _corrupt(
        tmp_path / "state", {key for key in FileSystemReader(tmp_path / "state").read_metadata().state_dict_metadata}
    )

    with pytest.raises(
        TrainingStateError, match=r"(?s)loaded nothing: rank 0: UnpicklingError: .*; the model is unchanged"
    ):
        model.load_state(tmp_path / "state")
    assert model.run_on_ranks(storages)[0] == held
    assert model.step == 2 and np.isfinite(model.train_step(batch(seed=3))["loss"])


def test_a_read_failing_after_copies_ends_the_group(load_local, tiny, tmp_path):
    """The model's entries are read first; a corrupt moment chunk fails the read after they were overwritten."""
    model = load_local(tiny)
    model.configure_training(lr=1e-3)
    model.train_step(batch(seed=1))
    model.save_state(tmp_path / "state")
    keys = FileSystemReader(tmp_path / "state").read_metadata().state_dict_metadata
    _corrupt(tmp_path / "state", {[key for key in keys if key.endswith(".exp_avg_sq")][-1]})

    with pytest.raises(
        LocalRankError, match=r"(?s)PartialLoadError: .*in place: rank 0: UnpicklingError: .*load the model again"
    ):
        model.load_state(tmp_path / "state")
    assert not model.is_alive
