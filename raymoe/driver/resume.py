"""A Trainer's place in its run, as a training state records it, and the checks for continuing from one.

Each state a Trainer writes carries its position in the manifest's ``extra["trainer"]``::

    {"step": 6, "samples_seen": 48, "global_batch_size": 8, "seed": 0, "train_rows": 240, "steps": 80,
     "data_order": "rows"}

A run continues from a state only with the same ``global_batch_size``, ``seed``, training rows and data order
(``"rows"``: one shuffle of every row, data on the driver; ``"blocks:<digest>"``: rows in Ray's object store,
shuffled by block, a digest of which block each row is in; :mod:`raymoe.driver.batch_order`), at a step within
``steps``. The state's optimizer and
balance settings are restored as saved; any that differ from this run's config are named in a warning.
"""

from __future__ import annotations

import logging
from dataclasses import asdict
from typing import Any

from raymoe.driver.states import CheckedState
from raymoe.driver.trainer_config import TrainerConfig

logger = logging.getLogger(__name__)

POSITION_KEY = "trainer"


def position(step: int, config: TrainerConfig, train_rows: int, data_order: str) -> dict[str, Any]:
    """The Trainer's place in its run at ``step``, saved in each state's manifest (``extra["trainer"]``)."""
    return {
        "data_order": data_order,
        "step": step,
        "samples_seen": step * config.global_batch_size,  # the global sample offset
        "global_batch_size": config.global_batch_size,
        "seed": config.seed,
        "train_rows": train_rows,
        "steps": config.steps,
    }


def resume_step(state: CheckedState, config: TrainerConfig, train_rows: int, data_order: str) -> int:
    """The step a run continues at from ``state``; a ``ValueError`` when this config and data cannot continue it."""
    path, manifest = state.directory, state.manifest
    saved = manifest.extra.get(POSITION_KEY)
    if not isinstance(saved, dict):
        raise ValueError(
            f"training state {path} holds no Trainer position (extra[{POSITION_KEY!r}]): it was not written by a "
            "Trainer; load it with model.load_state(...) instead"
        )
    current = {
        "global_batch_size": config.global_batch_size,
        "seed": config.seed,
        "train_rows": train_rows,
        "data_order": data_order,
    }
    saved = {"data_order": "rows", **saved}  # states from before data orders were named: every row shuffled
    for name, value in current.items():
        if saved.get(name) != value:
            raise ValueError(
                f"cannot resume from {path}: {name}={value} here, but the saved run had {name}={saved.get(name)}; "
                "the data order and position continue only with the same global_batch_size, seed, training rows and "
                "data order (rows on the driver, or the same blocks in Ray's object store)"
            )
    step = manifest.step
    if saved.get("samples_seen") != step * config.global_batch_size:
        raise ValueError(
            f"training state {path}: samples_seen={saved.get('samples_seen')} does not match step {step} x "
            f"global_batch_size {config.global_batch_size}"
        )
    if step > config.steps:
        raise ValueError(
            f"cannot resume from {path}: it is at step {step}, past steps={config.steps}; raise steps to go on from it"
        )
    return step


def warn_changed_settings(state: CheckedState, config: TrainerConfig) -> None:
    """Name the settings of ``config`` the state replaces (the state's win, as they shaped its moments); the
    learning rate follows the schedule either way."""
    mine, saved = asdict(config.optimizer()), asdict(state.optimizer)
    changed = [f"{key}={mine[key]!r} -> {saved[key]!r}" for key in saved if key != "lr" and mine[key] != saved[key]]
    if changed:
        logger.warning("resuming from %s restores the saved run's settings: %s", state.directory, ", ".join(changed))
