"""A LoRA training state out of the cluster, in one process: its PEFT adapter, or the merged hub checkpoint.

    raymoe export --adapter STATE OUT              export_adapter: adapter_config.json + adapter_model.safetensors
    raymoe export --merge STATE OUT --base BASE    export_merged: config.json + safetensors of W + s B A

A LoRA state holds the factors (and what a run moves beside them, like a router's selection bias), not the frozen
base (:mod:`raymoe.checkpoint.training_state`). Both exports rebuild the model on meta from the manifest (its model
config, and its ``lora``: the adapter's ``adapter_config.json``), add the factors, check every entry against the
state (:func:`~raymoe.checkpoint.training_state.check_training_state`) and read one tensor at a time. The merge
reads each base weight from ``BASE`` (any layout the family's checkpoints come in; MXFP4 experts are dequantized
to bf16 and written so), after checking ``BASE`` is the checkpoint the state was trained on (its fingerprint:
:mod:`raymoe.checkpoint.fingerprint`). Writing is all or nothing, as every save.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

from torch import Tensor

from raymoe.checkpoint.adapter import write_adapter
from raymoe.checkpoint.export import (
    read_entries,
    refuse_export_into_itself,
    state_location,
    write_into,
    written_dtype,
)
from raymoe.checkpoint.fingerprint import fingerprint_base
from raymoe.checkpoint.hub import resolve_checkpoint
from raymoe.checkpoint.model_io import reader_for, save_model
from raymoe.checkpoint.reader import CheckpointReader
from raymoe.checkpoint.storage import Location, UserPath
from raymoe.checkpoint.training_state import StateManifest, TrainingStateError, check_training_state, read_manifest
from raymoe.checkpoint.writer import DEFAULT_MAX_SHARD_SIZE
from raymoe.models.common.config import read_config_file
from raymoe.models.common.decoder import CausalLM
from raymoe.models.common.lora import adapter_parameters, frozen_base_names, merge_stream
from raymoe.models.registry import build_model, parse_model_config
from raymoe.spec.lora import LoraConfig, LoraSpec, add_adapters, resolve_lora


def export_adapter(state_dir: UserPath, out_dir: UserPath) -> list[Path] | list[str]:
    """Write the adapters of the LoRA training state ``state_dir`` as a PEFT adapter directory ``out_dir`` (what
    ``save_adapter`` writes); returns the files written. Either may be a storage URL, as for ``export_state``."""
    state = state_location(state_dir)
    manifest, model, lora = _lora_model(state, out_dir)
    tensors = dict(read_entries(state, adapter_parameters(model)))
    source = manifest.base.source if manifest.base is not None else None
    return write_into(
        out_dir, lambda local: write_adapter(local, lora.config.to_peft_dict(source), lora.targets, tensors)
    )


def export_merged(
    state_dir: UserPath,
    out_dir: UserPath,
    base: str | os.PathLike[str],
    *,
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
) -> list[Path] | list[str]:
    """Write the hub checkpoint of ``base`` with the adapters of the LoRA state ``state_dir`` merged in (``W + s B
    A``, what ``save_pretrained`` of the LoRA model writes) into ``out_dir``; returns the weight files written.

    ``base`` (a directory or a hub id) must be the checkpoint the state was trained on: its config and sampled
    tensors are compared with the state's fingerprint first, and a mismatch is a :class:`TrainingStateError`
    that writes nothing."""
    state = state_location(state_dir)
    manifest, model, lora = _lora_model(state, out_dir)
    directory = resolve_checkpoint(base)
    found = fingerprint_base(str(base), read_config_file(directory), directory)
    if manifest.base is not None and manifest.base.differences(found):
        raise TrainingStateError(
            f"--base {base} is not the checkpoint training state {state} was trained on "
            f"({manifest.base.source}): {'; '.join(manifest.base.differences(found))}"
        )
    with reader_for(directory, model) as reader:
        frozen = frozen_base_names(model)
        params = dict(model.named_parameters())
        reader.check({name: params[name].shape for name in frozen}, model_name=type(model).__name__)
        dtype = written_dtype(manifest, state)

        def write(local: Path) -> list[Path]:
            tensors = merge_stream(_base_and_state(reader, state, model, frozen), lora.targets)
            return save_model(model, local, max_shard_size=max_shard_size, tensors=tensors, dtype=dtype)

        return write_into(out_dir, write)


def _lora_model(state_dir: Location, out_dir: UserPath) -> tuple[StateManifest, CausalLM, LoraSpec]:
    """The state's manifest, its model on meta with the adapters, and the adapters' spec; checked against the state."""
    manifest = read_manifest(state_dir)
    refuse_export_into_itself(state_dir, out_dir)
    if manifest.lora is None:
        raise TrainingStateError(
            f"training state {state_dir} is a full fine-tuning state (no LoRA adapters): `raymoe export STATE_DIR "
            "OUT_DIR` writes its hub checkpoint"
        )
    try:
        config = parse_model_config(manifest.model_config)
        model = build_model(config, device="meta")
        lora = resolve_lora(LoraConfig.from_peft_dict(manifest.lora, where=f"{state_dir} (lora)"), model)
    except ValueError as error:
        raise TrainingStateError(
            f"training state {state_dir}: its model or LoRA config does not parse: {error}"
        ) from error
    add_adapters(model, lora)
    check_training_state(state_dir, model, config.model_type, with_optimizer=False)
    return manifest, model, lora


def _base_and_state(
    reader: CheckpointReader, state_dir: Location, model: CausalLM, frozen: set[str]
) -> Iterator[tuple[str, Tensor]]:
    """Every parameter in the model's order: a frozen base weight from the base checkpoint, anything else (the
    factors, a moved selection bias) from the state (one reader of it, in the same order)."""
    named = list(model.named_parameters())
    from_state = read_entries(state_dir, [(name, param) for name, param in named if name not in frozen])
    for name, _ in named:
        yield (name, reader.read(name)) if name in frozen else next(from_state)
