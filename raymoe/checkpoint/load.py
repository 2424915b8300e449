"""Loading a hub checkpoint into a model built on the meta device (single process).

    resolve (local dir or hub snapshot) -> parse config.json -> build on meta
        -> check every tensor against the model (one error listing all problems)
        -> read each parameter, assign it in place of the meta one -> re-tie embeddings

Sharded loaders follow the same steps but read blocks of each parameter through the same
:class:`CheckpointReader` (see :func:`open_checkpoint`).
"""

from __future__ import annotations

import os

import torch
from torch import Tensor, nn

from raymoe.checkpoint.hub import resolve_checkpoint
from raymoe.checkpoint.reader import CheckpointReader
from raymoe.models.config import load_model_config
from raymoe.models.decoder import CausalLM
from raymoe.models.registry import build_model


def open_checkpoint(
    name_or_path: str | os.PathLike[str],
    model: CausalLM,
    *,
    revision: str | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
) -> CheckpointReader:
    """A reader of checkpoint ``name_or_path`` (resolved like :func:`load_model`) in ``model``'s parameter names."""
    directory = resolve_checkpoint(name_or_path, revision=revision, cache_dir=cache_dir)
    return CheckpointReader(directory, model.hub_layout(), model.is_ignored_hub_key)


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
    with CheckpointReader(directory, model.hub_layout(), model.is_ignored_hub_key) as reader:
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
