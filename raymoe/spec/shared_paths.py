"""Local paths every rank's node must see as the driver sees them: the rule of a world that spans machines.

A rank reads its checkpoint shards and writes its training-state shards itself, so a local path (not a storage
URL) given on the driver is only usable when it names the same files on every node that hosts a rank: one machine,
or a filesystem all of them mount (NFS, Lustre, a FUSE mount of a bucket). The driver checks that before any rank
touches it, on the nodes that host ranks and are not its own (none on one machine: nothing runs then)::

    driver (node A)                          node B (ranks 4..7)            node C (ranks 8..11)
    SharedPath("from_pretrained path",       sees config.json 1 KB,         sees nothing at /ckpt
      /ckpt, files: config.json 1 KB,        model.safetensors 3 GB
      model.safetensors 3 GB)                -> ()                          -> ("/ckpt/config.json is missing", ...)
                                                                            => one ValueError naming C and its ranks

    read  (a checkpoint, an adapter, a state):  the files the driver lists, with their sizes
    write (output_dir, a save path):            a marker file the driver writes into the directory

:func:`problems_on_node` is what a node runs (plain ``os`` calls); :func:`check_seen` turns the answers into the one
error. Where the probe runs is the rank group's business (``actors/shared_paths.py``).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

MARKER_PREFIX = ".raymoe-shared-"
# the files of a checkpoint directory the ranks read (the whole tree of a training state is listed instead)
CHECKPOINT_SUFFIXES = (".json", ".safetensors")


@dataclass(frozen=True)
class SharedPath:
    """A local directory (absolute ``path``) and what the driver sees in it: ``files`` as
    ``(name relative to path, size in bytes)``. ``field`` names it in errors ("from_pretrained path")."""

    field: str
    path: str
    files: tuple[tuple[str, int], ...]


def read_path(field: str, directory: str | os.PathLike[str], *, every_file: bool = False) -> SharedPath:
    """What the ranks will read under ``directory``: its checkpoint files (``*.json``, ``*.safetensors``, at the
    top), or with ``every_file`` every file below it (a training state's tree)."""
    root = Path(directory)
    files = root.rglob("*") if every_file else root.iterdir()
    chosen = sorted(file for file in files if file.is_file() and (every_file or file.suffix in CHECKPOINT_SUFFIXES))
    return SharedPath(field, str(root), tuple((str(file.relative_to(root)), file.stat().st_size) for file in chosen))


def launch_reads(source: str, adapter_dir: str | None) -> tuple[SharedPath, ...]:
    """What the ranks of a launch read from local paths: the checkpoint directory (when ``source`` is one, not a
    hub id each node resolves itself) and a PEFT adapter directory."""
    needs = []
    if os.path.isabs(source) and os.path.isdir(source):
        needs.append(read_path("from_pretrained path", source))
    if adapter_dir is not None:
        needs.append(read_path("lora adapter", adapter_dir))
    return tuple(needs)


def write_path(field: str, directory: str | os.PathLike[str]) -> SharedPath:
    """A directory ranks will write into: created here (with its parents) and given a fresh marker file, which
    every node must then see; :func:`remove_marker` takes it away once they were asked."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    marker = root / f"{MARKER_PREFIX}{uuid.uuid4().hex}"
    marker.write_bytes(b"")
    return SharedPath(field, str(root), ((marker.name, 0),))


def remove_marker(shared: SharedPath) -> None:
    """Delete what :func:`write_path` wrote (nothing for a read path)."""
    for name, _ in shared.files:
        if name.startswith(MARKER_PREFIX):
            (Path(shared.path) / name).unlink(missing_ok=True)


def problems_on_node(needs: Sequence[SharedPath]) -> list[str]:
    """What this process's node does not see as the driver did: a missing file, or one of another size."""
    problems = []
    for need in needs:
        for name, size in need.files:
            file = os.path.join(need.path, name)
            try:
                seen = os.stat(file).st_size
            except OSError:
                problems.append(f"{need.field} {file} is missing")
                continue
            if seen != size:
                problems.append(f"{need.field} {file} is {seen} bytes there, {size} on the driver")
    return problems


def check_seen(needs: Sequence[SharedPath], seen_by_node: Mapping[str, tuple[Sequence[int], Sequence[str]]]) -> None:
    """Raise one ``ValueError`` when a node hosting ranks does not see ``needs`` as the driver does.

    ``seen_by_node``: node (its address) -> (the ranks on it, :func:`problems_on_node` there)."""
    blind = {node: answer for node, answer in seen_by_node.items() if answer[1]}
    if not blind:
        return
    fields = ", ".join(dict.fromkeys(f"{need.field}={need.path}" for need in needs))
    lines = [
        f"node {node} (ranks {_ranks(ranks)}) does not see it as the driver does: {'; '.join(problems[:3])}"
        + (f" (and {len(problems) - 3} more)" if len(problems) > 3 else "")
        for node, (ranks, problems) in sorted(blind.items())
    ]
    raise ValueError(
        f"{fields} is a local path, and this world's ranks run on other nodes too: every node that hosts a rank must "
        "see the same files (one machine, or a filesystem every node mounts); "
        + "; ".join(lines)
        + ". Put it on shared storage mounted at the same path on every node, or give a storage URL (s3://...)"
    )


def _ranks(ranks: Sequence[int]) -> str:
    ordered = sorted(ranks)
    if len(ordered) > 1 and ordered == list(range(ordered[0], ordered[-1] + 1)):
        return f"{ordered[0]}..{ordered[-1]}"
    return ", ".join(map(str, ordered))
