"""Saving a single-process model in its hub layout, loadable by transformers and by raymoe."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

from torch import Tensor

from raymoe.checkpoint.writer import DEFAULT_MAX_SHARD_SIZE, CheckpointWriter
from raymoe.models.decoder import CausalLM


def save_model(
    model: CausalLM,
    directory: str | os.PathLike[str],
    *,
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
    tensors: Iterable[tuple[str, Tensor]] | None = None,
) -> list[Path]:
    """Write ``config.json`` and the weights (per-expert hub tensors, sharded above ``max_shard_size`` bytes).

    ``tensors`` yields ``(parameter name, full tensor)`` in place of the model's own parameters,
    one at a time (a sharded model gathers each just before it is written).
    """
    with CheckpointWriter(directory, layout=model.hub_layout(), max_shard_size=max_shard_size) as writer:
        for name, tensor in tensors if tensors is not None else model.named_parameters():
            writer.write_parameter(name, tensor)
        files = writer.close()
    write_config(model, directory)
    return files


def write_config(model: CausalLM, directory: str | os.PathLike[str]) -> Path:
    """The ``config.json`` the model was built from, with the dtype of the weights being saved."""
    raw = dict(model.config.raw)
    raw["dtype"] = str(model.model.embed_tokens.weight.dtype).removeprefix("torch.")
    raw.pop("torch_dtype", None)  # the transformers 4 spelling of "dtype"; keep one
    raw.setdefault("model_type", model.model_type)
    raw.setdefault("architectures", [type(model).__name__])
    path = Path(directory) / "config.json"
    with path.open("w") as f:
        json.dump(raw, f, indent=2, sort_keys=True)
    return path
