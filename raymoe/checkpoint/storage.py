"""Storage URLs: where a checkpoint or a training state lives when it is not a local path (fsspec).

    "s3://bucket/run/ckpt"   -> StorageUrl  (s3fs; gs:// gcsfs, abfs:// / az:// adlfs, ...: any fsspec protocol)
    "hf://org/model"         -> StorageUrl, read only (huggingface_hub's filesystem)
    "file:///data/run"       -> not a StorageUrl: a local path (:mod:`raymoe.driver.local_paths`)

A URL is checked on the driver before anything starts: its protocol must be one fsspec knows and its package must
be installed (``s3://`` without s3fs is one ``ValueError`` naming s3fs), and a read-only protocol is refused where
raymoe writes. Every node reads and writes a URL itself with its own credentials (environment variables, an
instance role, fsspec's config): nothing travels through the driver.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

_URL = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*)://(?P<rest>.*)$")
READ_ONLY = frozenset({"hf", "http", "https", "github", "zip", "tar"})
LOCAL = frozenset({"file", "local"})


@dataclass(frozen=True)
class StorageUrl:
    """A place on a remote filesystem, ``protocol://path`` (no trailing ``/``), checked by :func:`storage_url`."""

    protocol: str
    path: str  # the URL without its protocol: "bucket/run/ckpt"

    def __str__(self) -> str:
        return f"{self.protocol}://{self.path}"

    def join(self, *names: str) -> StorageUrl:
        """The URL of ``names`` under this one."""
        return StorageUrl(self.protocol, "/".join([self.path, *names]))

    @property
    def name(self) -> str:
        return self.path.rsplit("/", 1)[-1]

    @property
    def parent(self) -> StorageUrl:
        return StorageUrl(self.protocol, self.path.rsplit("/", 1)[0])

    def filesystem(self) -> AbstractFileSystem:
        """fsspec's filesystem of this URL's protocol (one instance per process and protocol: fsspec caches it)."""
        import fsspec

        return fsspec.filesystem(self.protocol)


def url_scheme(text: str) -> str | None:
    """The lower-cased scheme of ``text`` when it is a URL (``s3://...``), else None."""
    match = _URL.match(text)
    return match.group("scheme").lower() if match else None


def storage_url(text: str, field: str, *, write: bool) -> StorageUrl:
    """``text`` (a URL of a non-local scheme) as a checked :class:`StorageUrl`; a ``ValueError`` naming ``field``
    when the protocol is unknown to fsspec, its package is not installed, it is read only and ``write`` is set, or
    the URL names no path."""
    match = _URL.match(text)
    if match is None or match.group("scheme").lower() in LOCAL:
        raise ValueError(f"{field}={text!r} is not a storage URL (protocol://path)")
    protocol, path = match.group("scheme").lower(), match.group("rest").strip("/")
    _check_protocol(protocol, text, field)
    if not path:
        raise ValueError(f"{field}={text!r} names no bucket or path after {protocol}://")
    if write and protocol in READ_ONLY:
        raise ValueError(
            f"{field}={text!r}: raymoe reads {protocol}:// URLs but does not write them; give a local path or a "
            "writable storage URL (s3://, gs://, abfs://, ...)"
        )
    return StorageUrl(protocol, path)


def _check_protocol(protocol: str, text: str, field: str) -> None:
    """The protocol is fsspec's and its filesystem imports (the missing package named, as fsspec names it)."""
    import fsspec
    from fsspec.registry import known_implementations

    if protocol not in known_implementations and protocol not in fsspec.available_protocols():
        raise ValueError(
            f"{field}={text!r}: {protocol}:// is not a filesystem fsspec knows; give a local path or a storage URL "
            "such as s3://bucket/path, gs://bucket/path or abfs://container/path"
        )
    try:
        fsspec.get_filesystem_class(protocol)
    except ImportError as error:
        package = known_implementations.get(protocol, {}).get("class", "").split(".", 1)[0] or protocol
        hint = " (pip install 'raymoe[s3]')" if protocol in ("s3", "s3a") else ""
        raise ValueError(
            f"{field}={text!r}: {protocol}:// URLs need the {package} package, which is not installed{hint}: {error}"
        ) from error


Location = Path | StorageUrl  # a local path, or a place on remote storage
UserPath = str | os.PathLike[str] | StorageUrl  # what a user may give where a storage URL is taken


def location_of(text: str) -> Location:
    """The location a driver sent as text (``str(path)`` or ``str(url)``), back as its type; on the ranks."""
    match = _URL.match(text)
    if match is None or match.group("scheme").lower() in LOCAL:
        return Path(text)
    return StorageUrl(match.group("scheme").lower(), match.group("rest").strip("/"))


def child(location: Location, name: str) -> Location:
    """``name`` under ``location``."""
    return location / name if isinstance(location, Path) else location.join(name)


def read_bytes(location: Location) -> bytes:
    """The whole file at ``location`` (``FileNotFoundError`` when there is none)."""
    if isinstance(location, Path):
        return location.read_bytes()
    data: bytes = location.filesystem().cat_file(location.path)
    return data


def write_bytes(location: Location, data: bytes) -> None:
    """``data`` as the whole file at ``location`` (one PUT on object storage)."""
    if isinstance(location, Path):
        location.write_bytes(data)
    else:
        location.filesystem().pipe_file(location.path, data)


def size_of(location: Location) -> int:
    """The size in bytes of the file at ``location`` (``FileNotFoundError`` when there is none)."""
    if isinstance(location, Path):
        return location.stat().st_size
    return int(location.filesystem().size(location.path))


def children(url: StorageUrl) -> dict[str, dict[str, Any]]:
    """What lies directly under ``url``, read afresh (fsspec's listing cache dropped): ``{name: fsspec's entry}``
    (``type`` "file" or "directory", ``size``, an ``ETag`` on object stores); empty when nothing is there."""
    fs = url.filesystem()
    fs.invalidate_cache(url.path)
    try:
        entries = fs.ls(url.path, detail=True)
    except FileNotFoundError:
        return {}
    return {str(entry["name"]).rstrip("/").rsplit("/", 1)[-1]: entry for entry in entries}


def is_directory(location: Location) -> bool:
    """Whether ``location`` is a directory (on object storage: a prefix that holds objects)."""
    if isinstance(location, Path):
        return location.is_dir()
    fs = location.filesystem()
    fs.invalidate_cache(location.path)
    return bool(fs.isdir(location.path))


def check_reachable(url: StorageUrl, field: str, *, write: bool) -> None:
    """One request on the driver before anything starts: the URL's storage answers with this process's credentials,
    and what is read exists (``write``: its bucket or container does; raymoe creates none). A ``ValueError`` naming
    ``field`` otherwise."""
    fs = url.filesystem()
    probed = url.path.split("/", 1)[0] if write else url.path
    try:
        found = bool(fs.exists(url.path)) or (write and bool(fs.exists(probed)))  # a bucket's own probe may be quiet
    except Exception as error:  # filesystem packages raise their own types (botocore's NoCredentialsError, ...)
        raise ValueError(
            f"{field}={str(url)!r}: cannot reach {url.protocol}:// storage: {type(error).__name__}: {error} (its "
            "credentials and endpoint come from the environment, e.g. AWS_* variables; every node needs them)"
        ) from error
    if not found:
        what = f"its bucket or container {probed!r}" if write else "it"
        raise ValueError(f"{field}={str(url)!r}: {what} does not exist" + (" (raymoe creates none)" if write else ""))
