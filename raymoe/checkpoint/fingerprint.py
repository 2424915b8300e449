"""Which base checkpoint a LoRA training state was trained on: a fingerprint in its manifest, checked on resume.

A LoRA state holds the adapters, not the frozen base (:mod:`raymoe.checkpoint.training_state`), so resuming it on
another base would silently train a different model. The fingerprint is what the driver can read cheaply::

    source          the checkpoint's path or hub id (informative only: a base may move between machines)
    config_sha256   of its config.json dict (keys sorted)
    tensors         hub tensor name -> sha256 of its shape, dtype and first SAMPLE_BYTES bytes, for up to
                    SAMPLE_TENSORS tensors spread over the sorted names (first, last, evenly between)

Two fingerprints match when their configs do and every sampled tensor they both name has the same digest. A hub id
whose weights the driver has not downloaded samples no tensors (the ranks fetch them); its config still counts.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from raymoe.checkpoint.reader import SafetensorsFiles

SAMPLE_TENSORS = 4
SAMPLE_BYTES = 1 << 20


@dataclass(frozen=True)
class BaseFingerprint:
    """The identity of a base checkpoint as far as the driver can tell it without reading its weights whole."""

    source: str
    config_sha256: str
    tensors: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"source": self.source, "config_sha256": self.config_sha256, "tensors": dict(self.tensors)}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> BaseFingerprint:
        tensors = raw.get("tensors") or {}
        if not isinstance(tensors, Mapping):
            raise TypeError(f"base.tensors={tensors!r} must be an object")
        return cls(str(raw["source"]), str(raw["config_sha256"]), {str(k): str(v) for k, v in tensors.items()})

    def differences(self, other: BaseFingerprint) -> list[str]:
        """What tells ``other`` apart from this fingerprint (empty: the same base as far as both can say)."""
        found = []
        if self.config_sha256 != other.config_sha256:
            found.append("its config.json differs")
        changed = [name for name in self.tensors if name in other.tensors and self.tensors[name] != other.tensors[name]]
        if changed:
            found.append(f"tensor {', '.join(changed[:3])} holds other values")
        return found


def config_digest(model_config: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(dict(model_config), sort_keys=True, default=str).encode()).hexdigest()


def fingerprint_base(
    source: str, model_config: Mapping[str, Any], weights: str | os.PathLike[str] | None
) -> BaseFingerprint:
    """The fingerprint of the checkpoint ``source`` (config ``model_config``; its safetensors in the directory
    ``weights`` when the driver has them, else None: no tensors are sampled)."""
    tensors: dict[str, str] = {}
    if weights is not None and _has_weights(Path(weights)):
        files = SafetensorsFiles(weights)
        try:
            tensors = {name: _tensor_digest(files, name) for name in _sampled(sorted(files.keys()))}
        finally:
            files.close()
    return BaseFingerprint(source, config_digest(model_config), tensors)


def _has_weights(directory: Path) -> bool:
    return any(directory.glob("*.safetensors"))


def _sampled(names: list[str]) -> list[str]:
    if len(names) <= SAMPLE_TENSORS:
        return names
    step = (len(names) - 1) / (SAMPLE_TENSORS - 1)
    return [names[round(i * step)] for i in range(SAMPLE_TENSORS)]


def _tensor_digest(files: SafetensorsFiles, name: str) -> str:
    """sha256 of the tensor's shape, dtype and its leading rows up to SAMPLE_BYTES (only those bytes are read)."""
    info = files.info(name)
    digest = hashlib.sha256(f"{info.shape}|{info.dtype}".encode())
    if info.shape and math.prod(info.shape) > 0:
        rest = tuple((0, size) for size in info.shape[1:])
        row = files.read(name, ((0, 1), *rest))
        rows = min(info.shape[0], max(1, SAMPLE_BYTES // max(1, row.numel() * row.element_size())))
        sample = files.read(name, ((0, rows), *rest)) if rows > 1 else row
        digest.update(sample.contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
