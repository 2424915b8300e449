"""Hub checkpoints: resolve, read (whole or any block of a parameter), load, and write back."""

from raymoe.checkpoint.hub import HUB_ALLOW_PATTERNS, resolve_checkpoint, resolve_config_file
from raymoe.checkpoint.model_io import (
    assign_parameter,
    load_model,
    load_weights,
    open_checkpoint,
    save_model,
    write_config,
)
from raymoe.checkpoint.reader import CheckpointReader, SafetensorsFiles
from raymoe.checkpoint.staging import CheckpointSaveError
from raymoe.checkpoint.writer import DEFAULT_MAX_SHARD_SIZE, CheckpointWriter

__all__ = [
    "DEFAULT_MAX_SHARD_SIZE",
    "HUB_ALLOW_PATTERNS",
    "CheckpointReader",
    "CheckpointSaveError",
    "CheckpointWriter",
    "SafetensorsFiles",
    "assign_parameter",
    "load_model",
    "load_weights",
    "open_checkpoint",
    "resolve_checkpoint",
    "resolve_config_file",
    "save_model",
    "write_config",
]
