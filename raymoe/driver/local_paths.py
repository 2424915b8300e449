"""A path a user gives for files raymoe writes or reads (output_dir, a checkpoint, a state, an adapter), made a local
absolute path on the driver, or refused with one clear error.

    "runs/a", "~/runs/a"       -> /abs/runs/a, /home/me/runs/a  (as before: taken from the driver's directory)
    "file:///data/run"         -> /data/run                     (a file URL is its path)
    "s3://bucket/run", "gs://" -> ValueError                    (storage URLs are not supported yet: without this
                                                                 check the run went to a local folder named "s3:")

A path must name a filesystem every rank and the driver see (one machine, or a shared mount on a cluster).
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Callable
from pathlib import Path
from urllib.parse import unquote, urlsplit

_URL = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*)://")


def local_path(value: str | os.PathLike[str], field: str) -> Path:
    """``value`` as an absolute local path (module doc); a ``ValueError`` naming ``field`` for a URL of another
    scheme, or a ``file://`` URL of another host."""
    text = os.fspath(value)
    match = _URL.match(text)
    if match is None:
        return Path(text).expanduser().absolute()
    scheme = match.group("scheme").lower()
    if scheme != "file":
        raise ValueError(
            f"{field}={text!r} is a {scheme}:// URL; raymoe reads and writes local paths only for now (storage URLs "
            "are not supported yet): mount the storage on every node and give its path"
        )
    parts = urlsplit(text)
    if parts.netloc not in ("", "localhost"):
        raise ValueError(f"{field}={text!r}: a file:// URL of host {parts.netloc!r}; give a path on this machine")
    return Path(unquote(parts.path)).absolute()


def path_flag(flag: str) -> Callable[[str], Path]:
    """The argparse ``type=`` of a command line's path flag (``examples/*.py``): :func:`local_path`, its error the
    flag's one usage error, where ``type=Path`` would turn ``s3://b/r`` into a local folder named ``s3:``."""

    def parse(text: str) -> Path:
        try:
            return local_path(text, flag)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    return parse
