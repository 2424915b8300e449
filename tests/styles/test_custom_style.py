"""A user's own style (SPEC STYLE-2): subclass the base, register it, name it in tp_plan, get the right model.

The style below is written the way a user would, straight on DTensor (its forward runs on
DTensors, not on local shards), and goes through the whole path: DistributedConfig -> resolve_plans
(validate_param on the meta model) -> apply_tp_rules -> forward and backward against the unsharded model.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from raymoe import DistributedConfig, ParallelStyle, register
from raymoe.plans import DefaultPlans, resolve_plans
from raymoe.styles import STYLES

H, INTER, LAYERS = 8, 12, 2


class ColwiseCustom(ParallelStyle):
    """Weight and bias Shard(0); input wrapped as a Replicate DTensor; output all-gathered to a plain tensor."""

    def __init__(self):
        self.outputs_gathered = 0

    def validate_param(self, module, param_name, param, mesh_size):
        if param.shape[0] % mesh_size:
            raise ValueError(f"{param_name} {tuple(param.shape)}: {param.shape[0]} rows do not split {mesh_size} ways")

    def shard_param(self, module, param_name, param, mesh):
        return nn.Parameter(distribute_tensor(param.detach(), mesh, [Shard(0)], src_data_rank=None))

    def transform_inputs_pre_forward(self, module, args, kwargs, mesh):
        return (DTensor.from_local(args[0], mesh, [Replicate()], run_check=False), *args[1:]), kwargs

    def transform_output_post_forward(self, module, output, mesh):
        self.outputs_gathered += 1
        return output.redistribute(placements=[Replicate()]).to_local()


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(H, INTER)
        self.down = nn.Linear(INTER, H)

    def forward(self, x):
        return self.down(F.silu(self.up(x)))


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = Mlp()
        self.norm = nn.RMSNorm(H)

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class Base(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(LAYERS))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class CausalLM(nn.Module):
    base_model_prefix = "model"

    def __init__(self):
        super().__init__()
        self.model = Base()

    def forward(self, x):
        return self.model(x)


DEFAULTS = DefaultPlans(tp={"model.layers.*.mlp.up": "colwise", "model.layers.*.mlp.down": "rowwise"})
# The user's override: the up projections use the custom style and gather their output, so down splits it again.
USER_PLAN = {"model.layers.*.mlp.up": "colwise_custom", "model.layers.*.mlp.down": "rowwise_split_input"}


def resolve_user_plan(tp_size):
    with torch.device("meta"):
        meta_model = CausalLM()
    config = DistributedConfig(tp_size=tp_size, fsdp_size=1, tp_plan=USER_PLAN)
    return resolve_plans(meta_model, DEFAULTS, config)


def check_custom_style_in_a_plan(rank):
    style = ColwiseCustom()
    register("colwise_custom", style)
    try:
        rules = resolve_user_plan(rank.world_size).tp_rules
        assert rules["model.layers.1.mlp.up"] == "colwise_custom"
        torch.manual_seed(0)
        full = CausalLM()
        model = rank.sharded_twin(full, rules)
        assert isinstance(model.model.layers[0].mlp.up.weight, DTensor)
        x = torch.randn(3, 5, H, generator=torch.Generator().manual_seed(1))
        rank.expect_close("output", model(x), full(x))
        assert style.outputs_gathered == LAYERS  # the registered instance ran, once per layer
        model(x).square().sum().backward()
        full(x).square().sum().backward()
        rank.expect_same_grads(model, full)
    finally:
        STYLES._styles.pop("colwise_custom", None)


def test_custom_style_named_in_tp_plan(tp2):
    tp2.run(check_custom_style_in_a_plan)


def test_custom_style_validate_param_runs_on_the_driver():
    register("colwise_custom", ColwiseCustom())
    try:
        with pytest.raises(ValueError, match=r"'colwise_custom' cannot shard weight \(12, 8\) over tp_size=5"):
            resolve_user_plan(5)
    finally:
        STYLES._styles.pop("colwise_custom", None)


def test_unregistered_custom_name_is_rejected():
    with pytest.raises(ValueError, match="unknown style 'colwise_custom'"):
        resolve_user_plan(2)
