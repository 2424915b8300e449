"""Checkpoint directories replaced whole or not at all: a save is staged beside its target and swapped in.

Everything a save writes goes into a staging directory beside the target (same parent, so every
rename stays on one filesystem) and is swapped in by two renames of whole directories::

    parent/
      ckpt/                    what loaders read: the old checkpoint, then the new one
      .ckpt.saving-<pid>/      the new one being written, then given hard links to the files
                               of ckpt/ it does not replace (tokenizer.json, README.md, ...)
      .ckpt.previous-<pid>/    the old one, during the swap only

      write, read back   ckpt/ = old, complete            .ckpt.saving-<pid>/ = new, growing
      rename 1           ckpt/ -> .ckpt.previous-<pid>/     ┐ a crash here: no ckpt/, the old one
      rename 2           .ckpt.saving-<pid>/ -> ckpt/       ┘ complete in .ckpt.previous-<pid>/
      remove             .ckpt.previous-<pid>/

At every instant ``ckpt/`` is the old checkpoint or the new one, each complete, except between the two
renames, when it does not exist and the old one is whole in ``.ckpt.previous-<pid>/``: the next save
renames it back before it starts, and removes the staging directories of saves that crashed
(:func:`recover_interrupted_save`, logged). A first save is one rename. If rename 2 fails, rename 1 is
undone; if that fails too, the error names where the old checkpoint is.

Whole directories, not file by file: one checkpoint is several files that change together (the dtype
in config.json, the shard count in every shard name, the index), and loaders disagree on which file
they look at first (transformers ``model.safetensors``, raymoe the index), so no order of per-file
renames keeps the directory loadable. The price: the parent directory must be writable, a mount
point cannot be a target (save into a directory inside it), files written into the target while a
save runs are lost with the old directory, and one save per target may run at a time.

Failures raise :class:`CheckpointSaveError` (an ``OSError`` with the cause's ``errno``) naming the
file and the cause, and leave the target as it was.
"""

from __future__ import annotations

import fnmatch
import json
import logging
import os
import re
import shutil
import stat
from pathlib import Path

_STAGING, _PREVIOUS = "saving", "previous"  # .<name>.saving-<pid>, .<name>.previous-<pid>

logger = logging.getLogger(__name__)


class CheckpointSaveError(OSError):
    """A checkpoint could not be written, read back or swapped in; ``errno`` is the disk's code when it gave one."""

    def __init__(self, message: str, errno: int | None = None) -> None:
        super().__init__(message)
        self.errno = errno


def write_json(path: Path, obj: object, *, sort_keys: bool = False) -> None:
    """``obj`` as indented JSON in ``path``, flushed to disk; a failure is a :class:`CheckpointSaveError` naming it."""
    try:
        with path.open("w") as f:
            json.dump(obj, f, indent=2, sort_keys=sort_keys)
            f.flush()
            os.fsync(f.fileno())
    except OSError as error:
        raise could_not("write", path, error) from error


def recover_interrupted_save(directory: str | os.PathLike[str]) -> None:
    """Undo what a save into ``directory`` that crashed left beside it (every save runs this first).

    A crash between the two renames of the swap left no ``directory`` and the old checkpoint whole
    in ``.<name>.previous-<pid>/``: it is renamed back. A ``.previous`` sibling next to an existing
    ``directory`` is from a swap that finished, and staging directories (``.<name>.saving-<pid>/``)
    are from saves that never did: both are removed. Each step is logged.
    """
    target = Path(os.path.realpath(directory))
    for previous in _siblings(target, _PREVIOUS):
        if os.path.lexists(target):
            shutil.rmtree(previous, ignore_errors=True)
            continue
        rename(previous, target)
        logger.warning(
            "restored the checkpoint %s from %s, where a save that did not finish had left it", target, previous
        )
    for staging in _siblings(target, _STAGING):
        shutil.rmtree(staging, ignore_errors=True)
        logger.warning("removed %s, left by a save into %s that did not finish", staging, target)


def swappable_target(directory: Path) -> Path:
    """The real path of ``directory`` (a symlink keeps pointing at the new checkpoint), its parent created."""
    target = Path(os.path.realpath(directory))
    if os.path.lexists(target) and not target.is_dir():
        raise CheckpointSaveError(f"cannot save a checkpoint into {directory}: it is a file, not a directory")
    if target.is_dir() and os.path.ismount(target):
        raise CheckpointSaveError(
            f"cannot save a checkpoint into {directory}: it is a mount point, and a save swaps in a whole new "
            "directory; save into a directory inside it"
        )
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise could_not("create the directory", target.parent, error) from error
    return target


def swap_in(staging: Path, target: Path, replaced: tuple[str, ...]) -> None:
    """Make the complete ``staging`` directory ``target``; the old one, if any, goes (module docstring). Entries of
    the old one matching a ``replaced`` pattern are dropped; the others are carried over."""
    if not os.path.lexists(target):
        rename(staging, target)  # a first save: one rename
        sync_directory(target.parent)
        return
    _carry_over(target, staging, replaced)
    sync_directory(staging)
    previous = _sibling(target, _PREVIOUS, os.getpid())
    rename(target, previous)
    try:
        rename(staging, target)
    except CheckpointSaveError as error:
        try:
            os.replace(previous, target)
        except OSError:
            raise CheckpointSaveError(
                f"{error}; putting the previous checkpoint back failed too: it is whole in {previous}, "
                f"and the next save into {target} renames it back",
                error.errno,
            ) from error
        raise
    sync_directory(target.parent)
    shutil.rmtree(previous, ignore_errors=True)


def _carry_over(target: Path, staging: Path, replaced: tuple[str, ...]) -> None:
    """Hard-link (copy where the filesystem cannot link) into ``staging`` each entry of ``target`` the new
    checkpoint does not replace: neither matching a ``replaced`` pattern nor a name the new save wrote."""
    for entry in sorted(target.iterdir()):
        copy = staging / entry.name
        if os.path.lexists(copy) or any(fnmatch.fnmatchcase(entry.name, p) for p in replaced):
            continue
        try:
            if entry.is_symlink():
                os.symlink(os.readlink(entry), copy)
            elif entry.is_dir():
                shutil.copytree(entry, copy, symlinks=True, copy_function=_link_or_copy)
            else:
                _link_or_copy(entry, copy)
        except OSError as error:
            raise could_not("carry over into the new checkpoint", entry, error) from error
    try:
        os.chmod(staging, stat.S_IMODE(target.stat().st_mode))
    except OSError as error:
        raise could_not("give the new checkpoint the permissions of", target, error) from error


def _link_or_copy(source: str | os.PathLike[str], destination: str | os.PathLike[str]) -> None:
    try:
        os.link(source, destination)
    except OSError:
        shutil.copy2(source, destination)


def staging_directory(target: Path) -> Path:
    """Where a save into ``target`` by this process stages its files: ``.<name>.saving-<pid>`` beside it."""
    return _sibling(target, _STAGING, os.getpid())


def _sibling(target: Path, kind: str, pid: int) -> Path:
    return target.parent / f".{target.name}.{kind}-{pid}"


def _siblings(target: Path, kind: str) -> list[Path]:
    """The ``.<name>.<kind>-<pid>`` directories beside ``target``, newest first."""
    prefix = f".{target.name}.{kind}-"
    try:
        entries = list(os.scandir(target.parent))
    except FileNotFoundError:
        return []
    found = [
        Path(entry.path)
        for entry in entries
        if entry.name.startswith(prefix) and entry.name[len(prefix) :].isdigit() and entry.is_dir(follow_symlinks=False)
    ]
    return sorted(found, key=lambda path: path.stat().st_mtime, reverse=True)


def rename(source: Path, destination: Path) -> None:
    try:
        os.replace(source, destination)
    except OSError as error:
        raise could_not(f"rename {source} to", destination, error) from error


def sync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_directory(path: Path) -> None:
    """Flush a directory's entries (renames) to disk; best effort, as some filesystems refuse it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def could_not(action: str, path: Path, error: BaseException) -> CheckpointSaveError:
    """``could not <action> <path>: <cause>``, with the cause's errno (safetensors gives it as ``(os error N)``)."""
    if isinstance(error, OSError) and error.strerror:
        cause, code = f"[Errno {error.errno}] {error.strerror}", error.errno
    else:
        found = re.search(r"\(os error (\d+)\)", str(error))
        cause = str(error) or type(error).__name__
        code = int(found.group(1)) if found else getattr(error, "errno", None)
    return CheckpointSaveError(f"could not {action} {path}: {cause}", code)
