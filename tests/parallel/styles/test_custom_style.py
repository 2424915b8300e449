"""A user's own style (SPEC STYLE-2): subclass the base, register it, name it in tp_plan, get the right model.

The style below is written the way a user would, straight on DTensor (its forward runs on
DTensors, not on local shards), and goes through the whole path: DistributedConfig -> resolve_plans
(validate_param on the meta model) -> apply_rules -> forward and backward against the unsharded model.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from raymoe import DistributedConfig, ParallelStyle, register
from raymoe.parallel.styles import STYLES
from raymoe.spec.plans import DefaultPlans, resolve_plans

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
        plans = resolve_user_plan(rank.world_size)
        assert plans.tp_rules["model.layers.1.mlp.up"] == "colwise_custom"
        assert plans.styles["colwise_custom"] is style  # the resolved plans carry the registered instance
        torch.manual_seed(0)
        full = CausalLM()
        model = rank.sharded_twin(full, plans.tp_rules, plans.styles)
        assert isinstance(model.model.layers[0].mlp.up.weight, DTensor)
        x = torch.randn(3, 5, H, generator=torch.Generator().manual_seed(1))
        rank.expect_close("output", model(x), full(x))
        assert style.outputs_gathered == LAYERS  # the registered instance ran, once per layer
        model(x).square().sum().backward()
        full(x).square().sum().backward()
        rank.expect_same_grads(model, full)
    finally:
        if "colwise_custom" in STYLES:
            STYLES.unregister("colwise_custom")


def test_custom_style_named_in_tp_plan(tp2):
    tp2.run(check_custom_style_in_a_plan)


def test_custom_style_validate_param_runs_on_the_driver():
    register("colwise_custom", ColwiseCustom())
    try:
        with pytest.raises(ValueError, match=r"'colwise_custom' cannot shard weight \(12, 8\) over tp_size=5"):
            resolve_user_plan(5)
    finally:
        if "colwise_custom" in STYLES:
            STYLES.unregister("colwise_custom")


def test_unregistered_custom_name_is_rejected():
    with pytest.raises(ValueError, match="unknown style 'colwise_custom'"):
        resolve_user_plan(2)


# --- across processes: registered on the driver, applied on Ray rank actors -------------------------------------

LLAMA = "llama_mha4"
# Gate and up projections gather their outputs with the custom style, so down splits its input again.
LLAMA_PLAN = {
    "model.layers.*.mlp.gate_proj": "colwise_custom",
    "model.layers.*.mlp.up_proj": "colwise_custom",
    "model.layers.*.mlp.down_proj": "rowwise_split_input",
}


def custom_style_on_rank(ctx):
    """What the rank applied to the up projections: the style's class and the weight's placement."""
    from raymoe.parallel.apply import applied_style

    up = ctx.require_model().model.model.layers[0].mlp.up_proj
    return type(applied_style(up)).__name__, str(up.weight.placements), tuple(up.weight.to_local().shape)


def test_a_style_registered_on_the_driver_reaches_the_ranks(world, tiny_checkpoint, load_hf_model):
    import sys

    from ray import cloudpickle

    import raymoe

    # A user's style class travels by value, as one defined in the driver script (__main__) does.
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    directory = tiny_checkpoint(LLAMA)
    ids = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = load_hf_model(directory)(input_ids=ids).logits
    register("colwise_custom", ColwiseCustom())
    try:
        config = DistributedConfig(tp_size=2, tp_plan=LLAMA_PLAN)
        with raymoe.from_pretrained(directory, distributed_config=config, world=world(2)) as model:
            applied = model.run_on_ranks(custom_style_on_rank)
            logits = model(ids)
    finally:
        if "colwise_custom" in STYLES:
            STYLES.unregister("colwise_custom")
    # The rank processes never saw the driver's registry: the instance came with the launch spec.
    assert applied == [("ColwiseCustom", "(Shard(dim=0),)", (48, 64))] * 2
    assert (logits - expected).abs().max().item() <= 1e-5
