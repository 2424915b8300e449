"""Load-balancing options (SPEC LB-2): checked when built, resolved against the model's config."""

from __future__ import annotations

import pytest

from raymoe import TrainerConfig
from raymoe.models import parse_model_config
from raymoe.spec.balance import BalanceConfig, BalanceOptions

QWEN3_MOE = {
    "model_type": "qwen3_moe",
    "vocab_size": 64,
    "hidden_size": 16,
    "intermediate_size": 32,
    "moe_intermediate_size": 8,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_experts": 4,
    "num_experts_per_tok": 2,
}
LLAMA = {"model_type": "llama", "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
         "num_attention_heads": 2}  # fmt: skip


def resolve(options: BalanceOptions, **config) -> BalanceConfig:
    return options.resolve(parse_model_config({**QWEN3_MOE, **config}))


def test_auto_follows_the_checkpoint():
    assert resolve(BalanceOptions()) == BalanceConfig()
    on = resolve(BalanceOptions(), output_router_logits=True, router_aux_loss_coef=0.02)
    assert on == BalanceConfig(aux_loss_coef=0.02)
    # a coefficient for the run overrides the checkpoint's, and turns the aux loss on
    assert resolve(BalanceOptions(router_aux_loss_coef=0.1)).aux_loss_coef == 0.1
    assert resolve(BalanceOptions(router_aux_loss_coef=0.0), output_router_logits=True).aux_loss_coef == 0.0


def test_telemetry_can_be_off_unless_a_method_needs_the_records():
    assert resolve(BalanceOptions(telemetry=False)).record_routing is False
    assert resolve(BalanceOptions("aux", telemetry=False)).record_routing is True


def test_explicit_methods():
    assert resolve(BalanceOptions("aux")).aux_loss_coef == 0.001  # the checkpoint's (transformers' default)
    assert resolve(BalanceOptions("layer_aux")) == BalanceConfig(aux_loss_coef=0.001, aux_loss_per_layer=True)
    assert resolve(BalanceOptions("none"), output_router_logits=True) == BalanceConfig()
    assert resolve(BalanceOptions("none", capacity_factor=1.25)) == BalanceConfig(capacity_factor=1.25)


def test_bias_balancing_needs_a_router_with_a_selection_bias():
    with pytest.raises(ValueError, match=r"needs a router with a per-expert selection bias .* qwen3_moe has none"):
        resolve(BalanceOptions("bias"))
    with pytest.raises(ValueError, match="qwen3_moe has none"):
        resolve(BalanceOptions("aux,bias"))


def test_a_dense_model_takes_no_balancing():
    llama = parse_model_config(LLAMA)
    assert BalanceOptions().resolve(llama) == BalanceConfig(record_routing=False)
    with pytest.raises(ValueError, match="llama is a dense model"):
        BalanceOptions("aux").resolve(llama)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"balance": "auxx"}, r"balance='auxx': choose one of auto, aux, layer_aux, bias, none, or an aux loss"),
        ({"balance": "aux,none"}, r"balance='aux,none'"),
        ({"balance": "aux,layer_aux"}, r"balance='aux,layer_aux'"),
        ({"balance": ""}, r"balance=''"),
        ({"router_aux_loss_coef": -0.1}, r"router_aux_loss_coef=-0.1 must be a number >= 0 or None"),
        ({"bias_update_rate": 0.0}, r"bias_update_rate=0.0 must be a number > 0"),
        ({"capacity_factor": -1.0}, r"capacity_factor=-1.0 must be a number > 0 or None"),
        ({"capacity_factor": float("inf")}, r"capacity_factor=inf"),
    ],
)
def test_bad_options_name_the_field_when_built(kwargs, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        BalanceOptions(**kwargs)
    with pytest.raises(ValueError, match=message):
        TrainerConfig(output_dir=tmp_path, **kwargs)  # the Trainer's config checks them too, before any rank
