"""A model's checkpoint in and out: a reader in its parameter names, a whole-model load, a hub-layout save.

    load_model   resolve (local dir or hub snapshot) -> parse config.json -> build on meta
                 -> check every tensor against the model (one error listing all problems)
                 -> read each parameter, assign it in place of the meta one -> re-tie embeddings
    save_model   config.json + weights in the hub layout (per-expert tensors), loadable by transformers,
                 staged beside the directory and swapped in whole (raymoe.checkpoint.writer)
    hub_tensors  the (hub name, tensor) pairs save_model writes for (parameter name, tensor) pairs, unwritten
                 (weights streamed to a rollout engine: raymoe.rank.weight_stream)

Sharded loading on the ranks (:mod:`raymoe.rank.load`) reads blocks of each parameter through the
same :class:`CheckpointReader` (:func:`open_checkpoint`); sharded saving streams gathered tensors
into :func:`save_model`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from torch import Tensor, nn

from raymoe.checkpoint.hub import resolve_checkpoint
from raymoe.checkpoint.reader import CheckpointReader, SafetensorsFiles
from raymoe.checkpoint.staging import write_json
from raymoe.checkpoint.writer import DEFAULT_MAX_SHARD_SIZE, CheckpointWriter
from raymoe.models.common.decoder import CausalLM
from raymoe.models.common.hub_layout import split_fused
from raymoe.models.common.shard_hints import FLOAT32_ATTR, float32_modules
from raymoe.models.registry import build_model, load_model_config


def open_checkpoint(
    name_or_path: str | os.PathLike[str],
    model: CausalLM,
    *,
    revision: str | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
) -> CheckpointReader:
    """A reader of checkpoint ``name_or_path`` (resolved like :func:`load_model`) in ``model``'s parameter names."""
    directory = resolve_checkpoint(name_or_path, revision=revision, cache_dir=cache_dir)
    return reader_for(directory, model)


def reader_for(directory: str | os.PathLike[str], model: CausalLM) -> CheckpointReader:
    """A reader of ``directory`` through the hub layout ``model`` picks for the tensors the checkpoint has."""
    files = SafetensorsFiles(directory)  # opened once: its tensor names pick the layout, then it is read
    try:
        layout = model.hub_layout(frozenset(files.keys()))
    except BaseException:
        files.close()
        raise
    return CheckpointReader(directory, layout, model.is_ignored_hub_key, files=files)


def check_checkpoint(directory: str | os.PathLike[str], model: CausalLM) -> None:
    """Every tensor ``model`` needs is in ``directory`` with its shape and a float dtype, every file readable:
    one ``ValueError`` naming the files and tensors otherwise. Reads only the safetensors headers."""
    with reader_for(directory, model) as reader:
        reader.check({name: param.shape for name, param in model.named_parameters()}, model_name=type(model).__name__)


def load_model(
    name_or_path: str | os.PathLike[str],
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    revision: str | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
) -> CausalLM:
    """The model of checkpoint ``name_or_path`` with its weights, in the checkpoint dtype unless ``dtype`` is given."""
    directory = resolve_checkpoint(name_or_path, revision=revision, cache_dir=cache_dir)
    model = build_model(load_model_config(directory), device="meta")
    with reader_for(directory, model) as reader:
        load_weights(model, reader, dtype=dtype, device=device)
    return model


def load_weights(
    model: CausalLM, reader: CheckpointReader, *, dtype: torch.dtype | None = None, device: torch.device | str = "cpu"
) -> None:
    """Replace every parameter of ``model`` (typically meta) by the checkpoint's, read whole."""
    params = dict(model.named_parameters())
    reader.check({name: param.shape for name, param in params.items()}, model_name=type(model).__name__)
    for name, param in params.items():
        tensor = reader.read(name).to(device=device, dtype=dtype or reader.dtype(name))
        assign_parameter(model, name, tensor, requires_grad=param.requires_grad)
    model.tie_weights()


def assign_parameter(model: nn.Module, name: str, tensor: Tensor, *, requires_grad: bool = True) -> None:
    """Make ``tensor`` the parameter ``name`` of ``model`` (no copy; the meta placeholder is dropped)."""
    owner_path, _, leaf = name.rpartition(".")
    owner = model.get_submodule(owner_path)
    setattr(owner, leaf, nn.Parameter(tensor, requires_grad=requires_grad))


def save_model(
    model: CausalLM,
    directory: str | os.PathLike[str],
    *,
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
    tensors: Iterable[tuple[str, Tensor]] | None = None,
    dtype: torch.dtype | None = None,
) -> list[Path]:
    """Write ``config.json`` and the weights (per-expert hub tensors, sharded above ``max_shard_size`` bytes).

    ``tensors`` yields ``(parameter name, full tensor)`` in place of the model's own parameters,
    one at a time (a sharded model gathers each just before it is written). ``dtype``: write the floating
    weights in it (a model holding float32 master weights saves the checkpoint's bf16), except the parameters
    the model keeps in float32 (a router's selection bias); None: as held.

    All or nothing: weights and ``config.json`` are staged beside ``directory``, read back and swapped in
    whole (:mod:`raymoe.checkpoint.staging`); files of ``directory`` the save does not write (a tokenizer,
    a README) are kept. A failure raises :class:`~raymoe.checkpoint.staging.CheckpointSaveError` (an
    ``OSError``) naming the file and the cause and leaves ``directory`` as it was.
    """
    named = tensors if tensors is not None else model.named_parameters()
    with CheckpointWriter(directory, layout=model.hub_layout(), max_shard_size=max_shard_size) as writer:
        for name, tensor in checkpoint_cast(model, named, dtype):
            writer.write_parameter(name, tensor)
        write_config(model, writer.staging, dtype)
        return writer.close()


def checkpoint_cast(
    model: CausalLM, tensors: Iterable[tuple[str, Tensor]], dtype: torch.dtype | None
) -> Iterator[tuple[str, Tensor]]:
    """``tensors`` (parameter name, tensor) with the floating ones in ``dtype`` (None: as they come), except the
    parameters ``model`` keeps in float32 (a router's selection bias): the cast :func:`save_model` writes."""
    modules = float32_modules(model)
    kept = {f"{path}.{name}" for path, module in modules.items() for name in getattr(module, FLOAT32_ATTR)}
    for name, tensor in tensors:
        if dtype is not None and tensor.is_floating_point() and name not in kept:
            tensor = tensor.to(dtype)
        yield name, tensor


def hub_tensors(
    model: CausalLM, tensors: Iterable[tuple[str, Tensor]], dtype: torch.dtype | None = None
) -> Iterator[tuple[str, Tensor]]:
    """``tensors`` (parameter name, full tensor) as the ``(hub name, tensor)`` pairs :func:`save_model` writes for
    them: cast by :func:`checkpoint_cast`, fused parameters split by ``model.hub_layout()`` (views of the parameter,
    or of its transposed copy; on the parameter's device)."""
    layout = model.hub_layout()
    for name, tensor in checkpoint_cast(model, tensors, dtype):
        if name not in layout:
            raise ValueError(f"{name!r} is not a parameter of the model's hub layout")
        yield from split_fused(layout[name], tensor.detach())


def write_config(model: CausalLM, directory: str | os.PathLike[str], dtype: torch.dtype | None = None) -> Path:
    """The ``config.json`` the model was built from, with the dtype of the weights being saved (``dtype``, or the
    model's own), written (and flushed to disk) into ``directory``; a failure is a ``CheckpointSaveError`` naming
    the file and the cause."""
    raw = dict(model.config.raw)
    raw["dtype"] = str(dtype or next(model.parameters()).dtype).removeprefix("torch.")
    raw.pop("torch_dtype", None)  # the transformers 4 spelling of "dtype"; keep one
    raw.pop("quantization_config", None)  # raymoe writes plain tensors (an MXFP4 checkpoint is saved dequantized)
    raw.setdefault("model_type", model.model_type)
    raw.setdefault("architectures", [type(model).__name__])
    path = Path(directory) / "config.json"
    write_json(path, raw, sort_keys=True)
    return path
