"""Activation checkpointing (``DistributedConfig(activation_checkpointing=...)``): the same losses, gradient norms
and weights as without it, under FSDP2 and under tp/fsdp/ep, while every decoder layer's forward really runs again
in backward."""

from __future__ import annotations

import sys

import pytest
import torch
from ray import cloudpickle

cloudpickle.register_pickle_by_value(sys.modules[__name__])

MOE = "moe_e8_k2_mha"
LAYOUTS = [{"fsdp_size": 2}, {"tp_size": 2, "fsdp_size": 2, "ep_size": 2}]


def count_layer_forwards(ctx) -> None:
    """Count the forwards of decoder layer 0's input norm (run again when the layer is recomputed)."""
    norm = ctx.require_model().model.model.layers[0].input_layernorm
    norm.forward_calls = 0

    def count(*_):
        norm.forward_calls += 1

    norm.register_forward_pre_hook(count)


def layer_forwards(ctx) -> int:
    return ctx.require_model().model.model.layers[0].input_layernorm.forward_calls


def full_weights(ctx) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {
        name: (p.full_tensor() if isinstance(p, DTensor) else p.detach()).clone()
        for name, p in ctx.require_model().model.named_parameters()
    }


def train(load_on_world, checkpoint, layout, mode, data):
    # eager even under `pytest --compiled-blocks`: the count is a forward hook inside the layer, which a compiled
    # block runs in its graph, not as a hook (compiled checkpointing: tests/rank/test_compiled_blocks.py)
    with load_on_world(checkpoint, {**layout, "activation_checkpointing": mode}, compile=False) as model:
        model.configure_training(lr=1e-3)
        model.run_on_ranks(count_layer_forwards)
        metrics = [model.train_step(ids, attention_mask=mask) for ids, mask in data]
        return (
            [(m["loss"], m["grad_norm"]) for m in metrics],
            model.run_on_ranks(full_weights)[0],
            model.run_on_ranks(layer_forwards)[0],
        )


@pytest.mark.parametrize("layout", LAYOUTS, ids=["fsdp2", "tp2_fsdp2_ep2"])
def test_checkpointing_changes_no_number_and_recomputes_each_layer(
    load_on_world, tiny_checkpoint, padded_batches, layout
):
    directory = tiny_checkpoint(MOE)
    data = padded_batches(96, steps=2, rows=8, seq=10)
    plain, plain_weights, plain_forwards = train(load_on_world, directory, layout, "none", data)
    assert plain_forwards == 2  # one forward per step
    for mode in ("full", "selective"):
        metrics, weights, forwards = train(load_on_world, directory, layout, mode, data)
        assert metrics == plain, mode
        assert all(torch.equal(weights[name], w) for name, w in plain_weights.items()), mode
        assert forwards == 4, mode  # each step's layer forward ran again in backward


def test_a_bad_mode_fails_on_the_driver():
    from raymoe import DistributedConfig

    with pytest.raises(ValueError, match="activation_checkpointing"):
        DistributedConfig(activation_checkpointing="some")
