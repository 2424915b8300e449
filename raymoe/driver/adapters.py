"""The handle's LoRA adapters: saving them in PEFT's format, and what trains and what is frozen.

``save_adapter`` gathers the factors (small beside the base: r * (in + out) per weight) from the first rank of
each pipeline stage and writes one PEFT directory from the driver, all or nothing
(:func:`raymoe.checkpoint.adapter.write_adapter`). The merged model goes through ``save_pretrained``.
"""

from __future__ import annotations

import os
from pathlib import Path

from torch import Tensor

from raymoe.checkpoint.adapter import write_adapter
from raymoe.checkpoint.storage import StorageUrl
from raymoe.checkpoint.upload import save_to_url
from raymoe.driver.fanout import FanOut
from raymoe.driver.local_paths import storage_path
from raymoe.rank.adapters import gather_adapters
from raymoe.rank.contract import AdapterTensors
from raymoe.spec.launch import LaunchSpec
from raymoe.spec.lora import LoraSpec


def require_lora(spec: LaunchSpec) -> LoraSpec:
    if spec.lora is None:
        raise ValueError(
            "this model has no LoRA adapters: load it with from_pretrained(..., lora=raymoe.LoraConfig(...)) or "
            "lora='ADAPTER_DIR'; save_pretrained writes the full model"
        )
    return spec.lora


def adapter_tensors(fanout: FanOut, spec: LaunchSpec) -> dict[str, Tensor]:
    """Every factor in full, on the driver (CPU), by raymoe path."""
    lora = require_lora(spec)
    answers: list[AdapterTensors] = fanout.every_rank(gather_adapters)
    tensors: dict[str, Tensor] = {}
    for answer in answers:
        tensors.update(answer.tensors)
    missing = sorted(set(lora.factor_names()) - set(tensors))
    if missing:
        raise RuntimeError(f"gathering LoRA factors: no rank answered {missing[:3]}")
    return tensors


def save_adapter(fanout: FanOut, spec: LaunchSpec, path: str | os.PathLike[str] | StorageUrl) -> list[Path] | list[str]:
    """Write the adapters as a PEFT directory at ``path`` (on the driver; a storage URL is written locally, then
    uploaded); the files written."""
    lora = require_lora(spec)
    directory = storage_path(path, "save_adapter path", write=True)
    tensors = adapter_tensors(fanout, spec)
    config = lora.config.to_peft_dict(spec.source)
    if isinstance(directory, StorageUrl):
        return save_to_url(directory, lambda local: write_adapter(local, config, lora.targets, tensors))
    return write_adapter(directory, config, lora.targets, tensors)


def describe_adapters(spec: LaunchSpec, trainable: int, frozen: int, trainable_bytes: int, frozen_bytes: int) -> str:
    """``LoRA: N targets (r ...); trainable ... parameters (... per rank), frozen ...``."""
    lora = require_lora(spec)
    ranks = sorted({target.shape.r for target in lora.targets})
    return (
        f"LoRA: {len(lora.targets)} adapted weights (r {', '.join(map(str, ranks))}), base frozen; per rank: "
        f"trainable {trainable:,} parameters ({trainable_bytes / 2**20:.2f} MiB), frozen {frozen:,} "
        f"({frozen_bytes / 2**20:.2f} MiB)"
    )
