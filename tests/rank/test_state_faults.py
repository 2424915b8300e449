"""save_state when a disk fails or a rank dies mid-save, on a 2-rank model: the previous state stays as it was.

Faults are injected for real inside the rank processes (``inject`` / ``heal`` through ``run_on_ranks``): ENOSPC
while rank 1 writes its shard file (DCP's writer), EIO on the rename that swaps the new state in (rank 0), and
rank 1's process exiting in the middle of its write (a killed rank). After each, the previous state is byte for
byte what it was, nothing half-written is taken for a state, and the handle (or, after the kill, a new one)
trains and saves on.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import inspect
import math
import os
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from ray import cloudpickle

from raymoe.checkpoint.staging import CheckpointSaveError
from raymoe.checkpoint.training_state import latest_state, state_dir_name

cloudpickle.register_pickle_by_value(sys.modules[__name__])

MOE = "moe_e8_k2_mha"
LAYOUT = {"fsdp_size": 2}

# fault -> what the error says
FAULTS = {
    "write_enospc": (
        r"rank 1: OSError: \[Errno 28\] No space left on device.* while writing into \S+/\.state\.saving-\d+"
    ),
    "swap_eio": r"could not rename \S+/\.state\.saving-\d+ to \S+/state: \[Errno 5\] Input/output error",
}


# --- on the ranks ---------------------------------------------------------------------------------


def inject(ctx, fault: str, target: str) -> None:
    from torch.distributed.checkpoint import filesystem

    from raymoe.checkpoint import staging

    if fault in ("write_enospc", "write_exit") and ctx.rank == 1:
        filesystem._write_item = _write_fails(filesystem._write_item, exits=fault == "write_exit")
    elif fault == "swap_eio" and ctx.rank == 0:
        staging.os.replace = _renames_to_fail(staging.os.replace, target)


def heal(ctx) -> None:
    from torch.distributed.checkpoint import filesystem

    from raymoe.checkpoint import staging

    for owner, name in ((filesystem, "_write_item"), (staging.os, "replace")):
        setattr(owner, name, inspect.unwrap(getattr(owner, name)))


def _write_fails(write_item, *, exits: bool):
    calls = []

    @functools.wraps(write_item)
    def failing(transforms, stream, data, *args, **kwargs):
        calls.append(1)
        if len(calls) < 3:  # some entries reach the disk first
            return write_item(transforms, stream, data, *args, **kwargs)
        if exits:
            os._exit(1)  # the process is gone mid-write, as under SIGKILL or an OOM kill
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    return failing


def _renames_to_fail(replace, target):
    failed = []

    @functools.wraps(replace)
    def failing(source, destination, **kwargs):
        if os.path.realpath(destination) == os.path.realpath(target) and not failed:  # once: putting back works
            failed.append(source)
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return replace(source, destination, **kwargs)

    return failing


def _full_weights(ctx) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {
        name: (p.full_tensor() if isinstance(p, DTensor) else p.detach()).clone()
        for name, p in ctx.require_model().model.named_parameters()
    }


# --- on the driver --------------------------------------------------------------------------------


@pytest.fixture
def model(load_on_world, tiny_checkpoint):
    with load_on_world(tiny_checkpoint(MOE), LAYOUT) as handle:
        handle.configure_training(lr=1e-2)
        yield handle


@contextmanager
def faulty(model, fault, target):
    model.run_on_ranks(inject, fault, str(target))
    try:
        yield
    finally:
        if model.is_alive:
            model.run_on_ranks(heal)


def batch(seed):
    return torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(seed))


def hashes(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir()) if p.is_file()}


@pytest.mark.parametrize("async_save", [False, True])
@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_failed_save_keeps_the_previous_state_and_the_model(model, tmp_path, fault, async_save):
    target = tmp_path / "state"
    model.train_step(batch(seed=1))
    model.save_state(target)
    before = hashes(target)
    model.train_step(batch(seed=2))  # the failed save has other values to write

    with faulty(model, fault, target), pytest.raises(CheckpointSaveError, match=FAULTS[fault]) as failure:
        model.save_state(target, async_save=async_save)
        model.wait_for_save()  # an asynchronous save's failure surfaces here
    assert failure.value.errno == (errno.ENOSPC if fault == "write_enospc" else errno.EIO)
    assert f"save_state({str(target)!r}) saved nothing" in str(failure.value)
    assert hashes(target) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state"]  # no staging directory left

    assert model.is_alive and math.isfinite(model.train_step(batch(seed=3))["loss"])
    weights = model.run_on_ranks(_full_weights)[0]
    model.save_state(target)
    model.train_step(batch(seed=4))
    model.load_state(target)  # the state saved after the failure is the model as it was then
    assert all(torch.equal(w, weights[n]) for n, w in model.run_on_ranks(_full_weights)[0].items())


def test_a_rank_killed_mid_save_leaves_the_previous_state(load_on_world, tiny_checkpoint, tmp_path):
    """Rank 1's process exits while writing state step 4: the group ends with a clear error, ``latest`` is still
    step 2, and a new handle loads it as it was saved."""
    states = tmp_path / "states"
    with load_on_world(tiny_checkpoint(MOE), LAYOUT) as model:
        model.configure_training(lr=1e-2)
        model.train_step(batch(seed=1))
        model.train_step(batch(seed=2))
        model.save_state(states / state_dir_name(2))
        saved = model.run_on_ranks(_full_weights)[0]
        model.train_step(batch(seed=3))
        model.train_step(batch(seed=4))
        model.run_on_ranks(inject, "write_exit", "")
        with pytest.raises(Exception, match=r"rank 1"):
            model.save_state(states / state_dir_name(4))
        assert not model.is_alive
    assert latest_state(states) == states / state_dir_name(2)
    leftovers = [p.name for p in states.iterdir() if p.name != state_dir_name(2)]
    assert all(name.startswith(f".{state_dir_name(4)}.saving-") for name in leftovers), leftovers
    with load_on_world(tiny_checkpoint(MOE), LAYOUT) as model:
        assert model.load_state(latest_state(states)).step == 2
        assert all(torch.equal(w, saved[n]) for n, w in model.run_on_ranks(_full_weights)[0].items())
        model.train_step(batch(seed=3))
        model.save_state(states / state_dir_name(3))  # the next save into the same parent clears nothing it needs
    assert latest_state(states) == states / state_dir_name(3)
