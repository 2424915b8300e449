"""The precision policy's decisions (raymoe.spec.precision): requests checked on the driver, policies resolved from
the checkpoint's dtype."""

import pytest
import torch

from raymoe.spec.launch import prepare_launch
from raymoe.spec.precision import Precision, precision_of, resolve_policy

BF16, FP32, FP16 = torch.bfloat16, torch.float32, torch.float16


@pytest.mark.parametrize(
    ("checkpoint", "dtype", "precision", "master", "compute", "written"),
    [
        (BF16, None, "auto", FP32, BF16, BF16),  # every hub MoE: fp32 masters by default
        (FP32, None, "auto", FP32, FP32, FP32),
        (FP32, BF16, "auto", FP32, BF16, BF16),  # dtype= is the compute dtype; its row of the table
        (BF16, None, "fp32", FP32, FP32, BF16),  # upcast to train, written back as the checkpoint was
        (BF16, None, "bf16-pure", BF16, BF16, BF16),
        (FP32, None, "bf16-mixed", FP32, BF16, FP32),
        (BF16, FP16, "auto", FP16, FP16, FP16),  # inference only
    ],
)
def test_a_policy_follows_the_request_and_the_checkpoint(checkpoint, dtype, precision, master, compute, written):
    policy = resolve_policy(precision_of(precision, dtype, False), dtype, checkpoint)
    assert (policy.master, policy.compute, policy.checkpoint) == (master, compute, written)
    assert policy.mixed == (master != compute)
    assert policy.reduce == (FP32 if policy.mixed else master)
    assert policy.trainable == (policy.precision is not Precision.FP16)


def test_fsdp_mixed_precision_asks_for_bf16_mixed():
    assert precision_of(None, None, True) is Precision.BF16_MIXED
    with pytest.raises(ValueError, match="precision='fp32' contradicts fsdp_mixed_precision=True"):
        precision_of("fp32", None, True)


@pytest.mark.parametrize(
    ("precision", "dtype", "message"),
    [
        ("bf16", None, r"precision='bf16' is not a precision policy; use one of 'auto', 'bf16-mixed', 'fp32'"),
        ("fp32", BF16, r"dtype=bfloat16 contradicts precision='fp32', which computes in float32"),
        ("bf16-pure", FP32, r"dtype=float32 contradicts precision='bf16-pure'"),
    ],
)
def test_a_bad_request_is_one_clear_error(precision, dtype, message):
    with pytest.raises(ValueError, match=message):
        precision_of(precision, dtype, False)


def test_prepare_launch_refuses_a_bad_precision_before_any_rank(tiny_checkpoint):
    with pytest.raises(ValueError, match="precision='half' is not a precision policy"):
        prepare_launch(tiny_checkpoint("moe_e8_k2_mha"), {}, world_size=1, precision="half")
    spec = prepare_launch(tiny_checkpoint("moe_e8_k2_mha"), {}, world_size=1, dtype="bfloat16", precision="bf16-mixed")
    assert spec.precision is Precision.BF16_MIXED
