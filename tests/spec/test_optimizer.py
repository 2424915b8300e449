"""OptimizerConfig: the one place AdamW defaults live, and its checks (each names the field)."""

from __future__ import annotations

import inspect

import pytest

from raymoe import DistributedModel, OptimizerConfig, TrainerConfig


def test_handle_and_trainer_take_their_defaults_from_it():
    defaults = OptimizerConfig()
    handle = inspect.signature(DistributedModel.configure_training).parameters
    trainer = TrainerConfig(output_dir="unused")
    for field in ("lr", "weight_decay", "betas", "eps", "max_grad_norm"):
        assert handle[field].default == getattr(defaults, field), field
        assert getattr(trainer, field) == getattr(defaults, field), field


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lr": 0}, r"training: lr=0 must be > 0"),
        ({"lr": float("nan")}, r"training: lr=nan must be > 0"),
        ({"lr": True}, r"training: lr=True must be > 0"),
        ({"weight_decay": -0.1}, r"weight_decay=-0.1 must be >= 0"),
        ({"eps": 0.0}, r"eps=0.0 must be > 0"),
        ({"betas": (0.9, 1.0)}, r"betas=\(0.9, 1.0\) must be two numbers in \[0, 1\)"),
        ({"betas": (0.9,)}, r"betas=\(0.9,\) must be two numbers"),
        ({"max_grad_norm": 0}, r"max_grad_norm=0 must be > 0 or None"),
    ],
)
def test_bad_values_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        OptimizerConfig(**kwargs)


def test_betas_as_a_list_become_a_tuple_and_with_lr_keeps_the_rest():
    config = OptimizerConfig(betas=[0.8, 0.9], max_grad_norm=None)
    assert config.betas == (0.8, 0.9)
    assert config.with_lr(0.5) == OptimizerConfig(lr=0.5, betas=(0.8, 0.9), max_grad_norm=None)
