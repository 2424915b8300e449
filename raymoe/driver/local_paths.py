"""A path a user gives for files raymoe writes or reads (output_dir, a checkpoint, a state, an adapter), made a local
absolute path on the driver, a checked storage URL where the field takes one, or refused with one clear error.

    "runs/a", "~/runs/a"       -> /abs/runs/a, /home/me/runs/a  (as before: taken from the driver's directory)
    "file:///data/run"         -> /data/run                     (a file URL is its path)
    "s3://bucket/run", "gs://" -> StorageUrl (:func:`storage_path`: save_pretrained, save_state, load_state), or
                                  ValueError (:func:`local_path`: fields that take local paths only; without this
                                  check the run went to a local folder named "s3:")

A local path must name a filesystem every rank and the driver see (one machine, or a shared mount on a cluster).
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Callable
from pathlib import Path
from urllib.parse import unquote, urlsplit

from raymoe.checkpoint.storage import LOCAL, StorageUrl, check_reachable, storage_url

_URL = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*)://")
# what takes storage URLs so far (the error of a local-only field says so)
URL_FIELDS = "save_pretrained, save_adapter, save_state, load_state and TrainerConfig's output_dir and resume_from"


def local_path(value: str | os.PathLike[str], field: str) -> Path:
    """``value`` as an absolute local path (module doc); a ``ValueError`` naming ``field`` for a URL of another
    scheme, or a ``file://`` URL of another host."""
    text = os.fspath(value)
    match = _URL.match(text)
    if match is None:
        return Path(text).expanduser().absolute()
    scheme = match.group("scheme").lower()
    if scheme not in LOCAL:
        raise ValueError(
            f"{field}={text!r} is a {scheme}:// URL; {field} takes a local path only for now (storage URLs are taken "
            f"by {URL_FIELDS}): mount the storage on every node and give its path"
        )
    parts = urlsplit(text)
    if parts.netloc not in ("", "localhost"):
        raise ValueError(f"{field}={text!r}: a file:// URL of host {parts.netloc!r}; give a path on this machine")
    return Path(unquote(parts.path)).absolute()


def storage_path(value: str | os.PathLike[str] | StorageUrl, field: str, *, write: bool) -> Path | StorageUrl:
    """``value`` as a local absolute path (:func:`local_path`, ``file://`` URLs included) or, for another scheme, a
    checked :class:`StorageUrl` (:func:`~raymoe.checkpoint.storage.storage_url`: known protocol, package installed,
    writable when ``write``; then :func:`~raymoe.checkpoint.storage.check_reachable`: one request to the storage)."""
    text = str(value) if isinstance(value, StorageUrl) else os.fspath(value)
    match = _URL.match(text)
    if match is None or match.group("scheme").lower() in LOCAL:
        return local_path(text, field)
    url = storage_url(text, field, write=write)
    check_reachable(url, field, write=write)
    return url


def path_flag(flag: str) -> Callable[[str], Path]:
    """The argparse ``type=`` of a command line's path flag (``examples/*.py``): :func:`local_path`, its error the
    flag's one usage error, where ``type=Path`` would turn ``s3://b/r`` into a local folder named ``s3:``."""

    def parse(text: str) -> Path:
        try:
            return local_path(text, flag)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    return parse


def storage_flag(flag: str, *, write: bool = True) -> Callable[[str], Path | StorageUrl]:
    """:func:`path_flag` of a flag that takes a storage URL too (``finetune.py --output-dir s3://bucket/run``):
    :func:`storage_path` for writing (or reading: ``write=False``), its error the flag's one usage error."""

    def parse(text: str) -> Path | StorageUrl:
        try:
            return storage_path(text, flag, write=write)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    return parse
