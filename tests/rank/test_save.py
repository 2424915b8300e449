"""save_pretrained when rank 0's disk fails, on a 2-rank model.

Faults are injected for real at the OS-level calls the writer makes, on rank 0 only (``inject`` and
``heal`` through ``run_on_ranks``): ENOSPC while writing the index, ENOSPC in the middle of the
shards (as safetensors reports it), EIO on the rename that swaps the new checkpoint in. Each time
the previous checkpoint stays byte for byte and loads in transformers, nothing half-written is left
beside it, the error names the file and the cause, and the same handle trains and saves afterwards.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import inspect
import math
import os
import re
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from ray import cloudpickle

from raymoe.checkpoint.staging import CheckpointSaveError

cloudpickle.register_pickle_by_value(sys.modules[__name__])

MOE = "moe_e8_k2_mha"
LAYOUT = {"fsdp_size": 2}
SMALL_SHARDS = 16 * 1024  # bytes: several shards and an index for the tiny model

# fault -> (what the error says, its errno)
FAULTS = {
    "index_enospc": (
        r"could not write \S+/\.ckpt\.saving-\d+/model\.safetensors\.index\.json: \[Errno 28\] No space left on device",
        errno.ENOSPC,
    ),
    "shard_enospc": (
        r"could not write \S+/\.ckpt\.saving-\d+/model-00002\.safetensors\.partial: .*No space left on device",
        errno.ENOSPC,
    ),
    "swap_eio": (r"could not rename \S+/\.ckpt\.saving-\d+ to \S+/ckpt: \[Errno 5\] Input/output error", errno.EIO),
}


# --- on the ranks ---------------------------------------------------------------------------------


def inject(ctx, fault: str, target: str) -> None:
    """On rank 0, make one OS-level call of the writer fail the way a broken disk does (``heal`` undoes it)."""
    if ctx.rank != 0:
        return
    from raymoe.checkpoint import staging, writer

    if fault == "index_enospc":
        staging.json.dump = _index_dump_hits_a_full_disk(staging.json.dump)
    elif fault == "shard_enospc":
        writer.save_file = _second_shard_hits_a_full_disk(writer.save_file)
    else:  # "swap_eio": the rename into place fails once; "swap_eio_always": every rename to the target fails
        staging.os.replace = _renames_to_fail(staging.os.replace, target, once=fault == "swap_eio")


def heal(ctx) -> None:
    if ctx.rank != 0:
        return
    from raymoe.checkpoint import staging, writer

    for owner, name in ((staging.json, "dump"), (writer, "save_file"), (staging.os, "replace")):
        setattr(owner, name, inspect.unwrap(getattr(owner, name)))


def _index_dump_hits_a_full_disk(dump):
    @functools.wraps(dump)
    def failing(obj, fp, **kwargs):
        if str(getattr(fp, "name", "")).endswith("model.safetensors.index.json"):
            fp.write('{"metadata": {')  # what got out before the disk filled up
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return dump(obj, fp, **kwargs)

    return failing


def _second_shard_hits_a_full_disk(save_file):
    from safetensors import SafetensorError

    calls = []

    @functools.wraps(save_file)
    def failing(tensors, filename, metadata=None):
        calls.append(filename)
        save_file(tensors, filename, metadata=metadata)
        if len(calls) == 2:  # half the file made it to disk, then safetensors gave up as it does on ENOSPC
            os.truncate(filename, os.path.getsize(filename) // 2)
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    return failing


def _renames_to_fail(replace, target, *, once):
    failed = []

    @functools.wraps(replace)
    def failing(source, destination, **kwargs):
        if os.path.realpath(destination) == os.path.realpath(target) and not (once and failed):
            failed.append(source)
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return replace(source, destination, **kwargs)

    return failing


# --- on the driver --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model(load_on_world, tiny_checkpoint):
    """One 2-rank model for the module: every test leaves it trainable (which is what the tests check)."""
    with load_on_world(tiny_checkpoint(MOE), LAYOUT) as handle:
        handle.configure_training(lr=1e-2)
        yield handle


@contextmanager
def faulty(model, fault, target):
    model.run_on_ranks(inject, fault, str(target))
    try:
        yield
    finally:
        model.run_on_ranks(heal)


def batch(seed):
    return torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(seed))


def hashes(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir()) if p.is_file()}


def assert_holds_the_model(directory, model, load_hf_model):
    """The checkpoint loads in transformers and gives the handle's logits."""
    ids = batch(seed=9)
    with torch.no_grad():
        assert (model(ids) - load_hf_model(directory)(input_ids=ids).logits).abs().max().item() <= 1e-5


@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_failed_save_keeps_the_previous_checkpoint_and_the_model(model, load_hf_model, tmp_path, fault):
    message, code = FAULTS[fault]
    target = tmp_path / "ckpt"
    model.save_pretrained(target, max_shard_size=SMALL_SHARDS)
    (target / "tokenizer.json").write_text('{"version": "1.0"}')
    before = hashes(target)
    model.train_step(batch(seed=1))  # the failed save has other weights to write

    with faulty(model, fault, target), pytest.raises(CheckpointSaveError, match=message) as failure:
        model.save_pretrained(target, max_shard_size=SMALL_SHARDS)
    assert failure.value.errno == code and f"save_pretrained({str(target)!r}) saved nothing" in str(failure.value)
    assert hashes(target) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no staging or previous directory left
    load_hf_model(target)

    assert model.is_alive and math.isfinite(model.train_step(batch(seed=2))["loss"])
    files = model.save_pretrained(target, max_shard_size=SMALL_SHARDS)
    assert len(files) > 1 and hashes(target)["tokenizer.json"] == before["tokenizer.json"]
    assert_holds_the_model(target, model, load_hf_model)


def test_a_swap_that_cannot_put_the_old_checkpoint_back_leaves_it_whole_for_the_next_save(
    model, load_hf_model, tmp_path
):
    target = tmp_path / "ckpt"
    model.save_pretrained(target)
    before = hashes(target)
    with faulty(model, "swap_eio_always", target), pytest.raises(CheckpointSaveError) as failure:
        model.save_pretrained(target)
    found = re.search(r"putting the previous checkpoint back failed too: it is whole in (\S+),", str(failure.value))
    assert found, str(failure.value)
    previous = Path(found.group(1))
    assert previous.name.startswith(".ckpt.previous-") and not target.exists()  # the crash-between-renames state
    assert sorted(tmp_path.iterdir()) == [previous] and hashes(previous) == before
    load_hf_model(previous)

    model.save_pretrained(target)  # renames the old one back, then swaps the new one in
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    assert_holds_the_model(target, model, load_hf_model)


@pytest.mark.parametrize("fault", ["shard_enospc", "swap_eio"])
def test_a_failed_first_save_leaves_nothing_behind(model, tmp_path, fault):
    message, _ = FAULTS[fault]
    with faulty(model, fault, tmp_path / "ckpt"), pytest.raises(CheckpointSaveError, match=message):
        model.save_pretrained(tmp_path / "ckpt", max_shard_size=SMALL_SHARDS)
    assert list(tmp_path.iterdir()) == []  # no directory, config-only or half


def test_a_save_keeps_the_files_it_does_not_write(model, load_hf_model, tmp_path):
    target = tmp_path / "ckpt"
    model.save_pretrained(target, max_shard_size=SMALL_SHARDS)
    (target / "tokenizer.json").write_text('{"version": "1.0"}')
    (target / "README.md").write_text("# fine-tuned")
    files = model.save_pretrained(target)
    assert [f.name for f in files] == ["model.safetensors"]
    assert sorted(p.name for p in target.iterdir()) == [
        "README.md",
        "config.json",
        "model.safetensors",
        "tokenizer.json",
    ]
    assert (target / "tokenizer.json").read_text() == '{"version": "1.0"}'
    assert (target / "README.md").read_text() == "# fine-tuned"
    assert_holds_the_model(target, model, load_hf_model)
