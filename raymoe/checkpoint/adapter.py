"""PEFT adapter directories: ``adapter_config.json`` + ``adapter_model.safetensors``, as PEFT reads and writes them.

Keys and shapes are those PEFT gives the transformers model of the family, whose module paths are raymoe's::

    raymoe factor              PEFT key (base_model.model. + ...)     shape
    P.lora_A     [r, in]       P.lora_A.weight                        [r, in]
    P.lora_B     [out, r]      P.lora_B.weight                        [out, r]
    M.w_lora_A   [E, r, in]    M{.base_layer * k}.lora_A.weight       [E*r, in]   rows expert-major
    M.w_lora_B   [E, out, r]   M{.base_layer * k}.lora_B.weight       [out, r*E]  columns expert-minor

``in`` / ``out`` are each expert weight's input and output features whatever the hub's orientation (gpt-oss stores
``x @ W``; PEFT's ``is_transposed`` swaps them back, so its factors read the same). Several targeted weights of one
module are nested wrappers in PEFT, in the order the module registers them (``gate_up_proj`` before ``down_proj``):
the last is outermost (``k = 0``), each earlier one a ``base_layer`` deeper.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from raymoe.checkpoint.staging import (
    could_not,
    recover_interrupted_save,
    staging_directory,
    swap_in,
    swappable_target,
    sync_file,
    write_json,
)
from raymoe.models.common.lora import AdapterTarget

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."


def peft_keys(targets: Iterable[AdapterTarget]) -> dict[str, tuple[AdapterTarget, str]]:
    """``{raymoe factor path: (target, PEFT key)}`` for every factor of ``targets``."""
    targets = list(targets)
    keys: dict[str, tuple[AdapterTarget, str]] = {}
    for target in targets:
        siblings = [t for t in targets if t.module == target.module and t.param is not None]
        depth = len(siblings) - 1 - siblings.index(target) if target.param is not None else 0
        stem = PREFIX + target.module + ".base_layer" * depth
        a_name, b_name = target.factor_names()
        keys[a_name] = (target, f"{stem}.lora_A.weight")
        keys[b_name] = (target, f"{stem}.lora_B.weight")
    return keys


def to_peft(target: AdapterTarget, factor: str, tensor: Tensor) -> Tensor:
    """A full factor in PEFT's layout (see the module docstring)."""
    if target.param is None:
        return tensor
    if factor.endswith("_lora_A"):
        experts, r, in_features = tensor.shape
        return tensor.reshape(experts * r, in_features)
    experts, out_features, r = tensor.shape
    return tensor.permute(1, 2, 0).reshape(out_features, r * experts)


def from_peft(target: AdapterTarget, factor: str, tensor: Tensor, shape: tuple[int, ...]) -> Tensor:
    """A PEFT tensor as the raymoe factor of global ``shape``; a ValueError naming both when they disagree."""
    if target.param is None:
        expected: tuple[int, ...] = shape
    elif factor.endswith("_lora_A"):
        expected = (shape[0] * shape[1], shape[2])
    else:
        expected = (shape[1], shape[2] * shape[0])
    if tuple(tensor.shape) != expected:
        raise ValueError(
            f"{factor}: the adapter holds {tuple(tensor.shape)}, the model needs {expected} (PEFT's layout)"
        )
    if target.param is None:
        return tensor
    if factor.endswith("_lora_A"):
        return tensor.reshape(shape)
    experts, out_features, r = shape
    return tensor.reshape(out_features, r, experts).permute(2, 0, 1).contiguous()


class AdapterFile:
    """The tensors of a PEFT adapter directory, read as raymoe factors (whole: adapters are small)."""

    def __init__(self, directory: str | os.PathLike[str], targets: Iterable[AdapterTarget]) -> None:
        self.path = Path(directory) / ADAPTER_WEIGHTS
        self.keys = peft_keys(targets)

    def check(self, shapes: Mapping[str, tuple[int, ...]]) -> None:
        """Every factor of ``shapes`` is in the file with its shape; no tensor of the file is left unused."""
        with safe_open(self.path, framework="pt") as handle:
            present = {key: tuple(handle.get_slice(key).get_shape()) for key in handle.keys()}  # noqa: SIM118 (a safe_open handle)
        wanted = {self.keys[name][1]: name for name in shapes}
        missing = sorted(key for key in wanted if key not in present)
        unused = sorted(key for key in present if key not in wanted)
        if missing or unused:
            raise ValueError(
                f"{self.path} does not match the LoRA targets of its adapter_config.json on this model: "
                f"missing {missing[:4]}{'...' if len(missing) > 4 else ''}, unused {unused[:4]}"
                f"{'...' if len(unused) > 4 else ''}"
            )
        for key, name in wanted.items():
            target = self.keys[name][0]
            from_peft(target, name, torch.empty(present[key], device="meta"), shapes[name])

    def read(self, name: str, shape: tuple[int, ...]) -> Tensor:
        target, key = self.keys[name]
        with safe_open(self.path, framework="pt") as handle:
            return from_peft(target, name, handle.get_tensor(key), shape)


def write_adapter(
    directory: str | os.PathLike[str],
    peft_config: Mapping[str, object],
    targets: Iterable[AdapterTarget],
    tensors: Mapping[str, Tensor],
) -> list[Path]:
    """Write a PEFT adapter directory (``peft_config``: its adapter_config.json) from full factors by raymoe path,
    all or nothing (staged beside it, then swapped in: :mod:`raymoe.checkpoint.staging`)."""
    keys = peft_keys(targets)
    target = swappable_target(Path(directory))
    recover_interrupted_save(target)
    staging = staging_directory(target)
    try:
        staging.mkdir()
    except OSError as error:
        raise could_not(f"create the staging directory of {target} at", staging, error) from error
    weights = {keys[name][1]: to_peft(keys[name][0], name, tensor).contiguous() for name, tensor in tensors.items()}
    save_file(weights, staging / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    sync_file(staging / ADAPTER_WEIGHTS)
    write_json(staging / ADAPTER_CONFIG, dict(peft_config), sort_keys=True)
    swap_in(staging, target, replaced=(ADAPTER_WEIGHTS, ADAPTER_CONFIG))
    return [target / ADAPTER_CONFIG, target / ADAPTER_WEIGHTS]
