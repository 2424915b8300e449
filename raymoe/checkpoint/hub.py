"""Finding a checkpoint: a local directory, a hub repository fetched into the local cache, or a storage URL
(``s3://bucket/model``, ``hf://org/model``) copied into a local cache on the node that reads it
(:mod:`raymoe.checkpoint.download`).

Only what raymoe reads is downloaded (config, safetensors weights and their index, tokenizer
files), never the ``.bin``/``.pth`` duplicates many repositories also carry. With
``HF_HUB_OFFLINE=1`` huggingface_hub answers from its cache without touching the network.
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import unquote, urlsplit

from raymoe.checkpoint.download import fetch_checkpoint
from raymoe.checkpoint.storage import LOCAL, StorageUrl, storage_url, url_scheme

HUB_ALLOW_PATTERNS = (
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "*.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
)


def resolve_checkpoint(
    name_or_path: str | os.PathLike[str],
    *,
    revision: str | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
) -> Path:
    """The local directory holding the checkpoint ``name_or_path`` (a directory, a hub repo id, or a storage URL)."""
    url = storage_source(name_or_path)
    if url is not None:
        return fetch_checkpoint(url, HUB_ALLOW_PATTERNS, cache_dir)
    local = _local_directory(name_or_path)
    if local is not None:
        return local
    return _from_hub(name_or_path, list(HUB_ALLOW_PATTERNS), revision, cache_dir)


def resolve_config_file(
    name_or_path: str | os.PathLike[str],
    *,
    revision: str | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
) -> Path:
    """Only ``config.json`` of the checkpoint: what the driver needs to validate a layout, without the weights."""
    url = storage_source(name_or_path)
    local = fetch_checkpoint(url, ["config.json"], cache_dir) if url is not None else _local_directory(name_or_path)
    directory = local if local is not None else _from_hub(name_or_path, ["config.json"], revision, cache_dir)
    path = directory / "config.json"
    if not path.is_file():
        raise ValueError(f"no config.json in {directory}: is {str(name_or_path)!r} a model checkpoint?")
    return path


def _local_directory(name_or_path: str | os.PathLike[str]) -> Path | None:
    """The directory ``name_or_path`` names (a ``file://`` URL its path), None for a hub id, or a ``ValueError`` for
    a bad path."""
    if url_scheme(str(name_or_path)) is not None:
        name_or_path = unquote(urlsplit(str(name_or_path)).path)
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise ValueError(f"{str(name_or_path)!r} is a file; pass the directory holding config.json and the weights")
    left = sorted(path.parent.glob(f".{path.name}.previous-*"))
    if left:  # a save crashed between its two renames (raymoe.checkpoint.staging)
        raise ValueError(
            f"checkpoint directory {str(name_or_path)!r} does not exist, but a save into it that did not finish left "
            f"the previous checkpoint whole in {left[-1]}; the next save there restores it, or rename it back"
        )
    if _looks_like_a_path(str(name_or_path)):
        raise ValueError(f"checkpoint directory {str(name_or_path)!r} does not exist")
    return None


def storage_source(name_or_path: str | os.PathLike[str]) -> StorageUrl | None:
    """``name_or_path`` as a checked storage URL (read only), None when it is a path, a ``file://`` URL or a hub id."""
    scheme = url_scheme(str(name_or_path))
    if scheme is None or scheme in LOCAL:
        return None
    return storage_url(str(name_or_path), "checkpoint", write=False)


def _from_hub(
    name: str | os.PathLike[str],
    allow_patterns: list[str],
    revision: str | None,
    cache_dir: str | os.PathLike[str] | None,
) -> Path:
    # Imported here, for a hub id: every rank process imports this module, and most never resolve one (~0.3
    # CPU-seconds of import each).
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        snapshot = snapshot_download(
            repo_id=str(name),
            revision=revision,
            cache_dir=Path(cache_dir) if cache_dir is not None else None,
            allow_patterns=allow_patterns,
        )
    except (LocalEntryNotFoundError, RepositoryNotFoundError, HFValidationError) as exc:
        raise ValueError(
            f"cannot resolve checkpoint {str(name)!r}: it is not a local directory and the hub snapshot "
            f"is unavailable ({type(exc).__name__}: {exc})"
        ) from exc
    return Path(snapshot)


def _looks_like_a_path(name: str) -> bool:
    """Hub ids are ``name`` or ``owner/name``; anything else that is not a directory was meant as a path."""
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or "\\" in name
