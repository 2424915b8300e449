"""What the trackers are given: a step's scalars (from its ``metrics.jsonl`` record and the per-layer routing
telemetry of ``train_step``) and a run's hyperparameters and descriptions.

    loss, lm_loss, aux_loss, lr, grad_norm, tokens_per_s, num_tokens, eval_loss,     as in the record (the two
    compile_s, eval_compile_s                                                         compile times where a step or
                                                                                      an evaluation compiled)
    routing/max_expert_imbalance, routing/max_rank_imbalance, routing/dead_experts,   the record's worst layer
    routing/dropped_pairs                                                             and totals
    routing/expert_imbalance/layer_<i>, routing/dead_experts/layer_<i>                per MoE layer <i> (0-based,
                                                                                      counting MoE layers)
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from raymoe.driver.trackers.protocol import Param

if TYPE_CHECKING:
    from raymoe.driver.handle import DistributedModel
    from raymoe.driver.trainer_config import TrainerConfig

SCALARS = (
    "loss", "lm_loss", "aux_loss", "lr", "grad_norm", "tokens_per_s", "num_tokens", "eval_loss", "compile_s",
    "eval_compile_s",
)  # fmt: skip
ROUTING = ("max_expert_imbalance", "max_rank_imbalance", "dead_experts", "dropped_pairs")
PER_LAYER = ("expert_imbalance", "dead_experts")


def step_scalars(record: Mapping[str, Any], per_layer: Mapping[str, Any] | None = None) -> dict[str, float]:
    """The scalars of a step's record (a train step, the evaluation at step 0) and its per-layer telemetry
    (``train_step``'s lists, one entry per MoE layer). Empty for a record that is neither (a restart)."""
    values = {key: float(record[key]) for key in SCALARS if isinstance(record.get(key), int | float)}
    values.update({f"routing/{key}": float(record[key]) for key in ROUTING if key in record})
    for key in PER_LAYER:
        for layer, value in enumerate((per_layer or {}).get(key, [])):
            values[f"routing/{key}/layer_{layer}"] = float(value)
    return values


def run_params(config: TrainerConfig, model: DistributedModel) -> dict[str, Param]:
    """The run's hyperparameters, flat: ``trainer/<field>`` (every ``TrainerConfig`` field), ``layout/<field>``
    (the resolved ``DistributedConfig``), ``model/...`` (what was loaded)."""
    params: dict[str, Param] = {}
    for item in dataclasses.fields(config):
        params[f"trainer/{item.name}"] = _param(getattr(config, item.name))
    for key, value in model.topology.config.model_dump().items():
        params[f"layout/{key}"] = _param(value)
    params["layout/world_size"] = model.topology.world_size
    params["model/source"] = model.source
    params["model/model_type"] = model.model_config.model_type
    params["model/expert_mode"] = model.plans.expert_mode
    params["model/lora"] = model.lora is not None
    return params


def run_texts(model: DistributedModel) -> dict[str, str]:
    """The longer descriptions of a run: the rank picture and precision (``model.describe()``) and the merged plans."""
    plans = {"tp_plan": model.tp_plan, "ep_plan": model.ep_plan, "fsdp_plan": model.fsdp_plan}
    return {"describe": model.describe(), "plans": json.dumps(plans, indent=1, sort_keys=True)}


def _param(value: object) -> Param:
    """A hyperparameter as a tool takes it: bools, ints, floats and strings as they are, anything else as text."""
    if isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, Path):
        return str(value)
    return "None" if value is None else str(list(value) if isinstance(value, tuple) else value)
