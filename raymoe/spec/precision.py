"""The precision policy: which dtype holds the weights, their gradients and the AdamW states (the *master*
dtype) and which one forward and backward compute in (the *compute* dtype); one decision per model (issue 36).

    precision     master   compute   gradients reduced in   when
    "bf16-mixed"  fp32     bf16      fp32                   the default for a bf16 checkpoint
    "fp32"        fp32     fp32      fp32                   the default for an fp32 checkpoint
    "bf16-pure"   bf16     bf16      bf16                   only when asked: updates below bf16's resolution
                                                            (lr 1e-5 on a weight of ~1) are lost; a warning
                                                            when training is configured
    "fp16"        fp16     fp16      fp16                   inference only: fp16 training needs dynamic loss
                                                            scaling, which raymoe does not have (refused)

``"auto"`` (the default) takes the compute dtype from ``dtype=`` or, without it, from the checkpoint, and
the row of that dtype. Whatever the policy, a router's selection bias (``e_score_correction_bias``,
DeepSeek-V3 / GLM-4.5) is held and used in fp32, as transformers keeps it. ``save_pretrained`` writes the
checkpoint's own dtype (or ``dtype=``'s), never the master's; training states keep the master dtype.

Where FSDP2 wraps, the compute dtype is its ``MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=fp32)``;
a mixed policy wraps a layout with no data parallelism in FSDP2 over one rank for the same split
(:func:`raymoe.rank.load.uses_fsdp`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


class Precision(enum.StrEnum):
    AUTO = "auto"
    BF16_MIXED = "bf16-mixed"
    FP32 = "fp32"
    BF16_PURE = "bf16-pure"
    FP16 = "fp16"


# The compute dtype each explicit precision implies (a ``dtype=`` given beside it must be that one).
_COMPUTE = {
    Precision.BF16_MIXED: torch.bfloat16,
    Precision.FP32: torch.float32,
    Precision.BF16_PURE: torch.bfloat16,
    Precision.FP16: torch.float16,
}
_MASTER = {
    Precision.BF16_MIXED: torch.float32,
    Precision.FP32: torch.float32,
    Precision.BF16_PURE: torch.bfloat16,
    Precision.FP16: torch.float16,
}
# "auto": the precision of a compute dtype.
_AUTO = {torch.bfloat16: Precision.BF16_MIXED, torch.float32: Precision.FP32, torch.float16: Precision.FP16}


@dataclass(frozen=True)
class PrecisionPolicy:
    """A resolved policy (never ``auto``): ``master`` holds weights, gradients and optimizer states,
    ``compute`` runs forward and backward, ``reduce`` sums gradients across ranks, ``checkpoint`` is
    what ``save_pretrained`` writes."""

    precision: Precision
    master: torch.dtype
    compute: torch.dtype
    checkpoint: torch.dtype

    @property
    def mixed(self) -> bool:
        """Compute in a narrower dtype than the weights are held in."""
        return self.master != self.compute

    @property
    def reduce(self) -> torch.dtype:
        return torch.float32 if self.mixed else self.master

    @property
    def trainable(self) -> bool:
        return self.precision is not Precision.FP16

    def describe(self) -> str:
        return (
            f"precision {self.precision.value}: {_name(self.master)} weights, gradients and optimizer states, "
            f"{_name(self.compute)} compute, {_name(self.reduce)} gradient reduction, "
            f"{_name(self.checkpoint)} checkpoints"
        )


def precision_of(precision: Precision | str | None, dtype: torch.dtype | None, fsdp_mixed_precision: bool) -> Precision:
    """Check a request on the driver: ``precision`` (None: ``auto``) against ``dtype=`` and the older
    ``DistributedConfig.fsdp_mixed_precision`` (which asks for ``bf16-mixed``)."""
    choice = _parse(precision)
    if fsdp_mixed_precision:
        if choice not in (Precision.AUTO, Precision.BF16_MIXED):
            raise ValueError(
                f"precision={choice.value!r} contradicts fsdp_mixed_precision=True (which is precision='bf16-mixed');"
                " drop one of them"
            )
        choice = Precision.BF16_MIXED
    if choice is not Precision.AUTO and dtype is not None and dtype != _COMPUTE[choice]:
        raise ValueError(
            f"dtype={_name(dtype)} contradicts precision={choice.value!r}, which computes in "
            f"{_name(_COMPUTE[choice])}; give one of them (dtype= alone keeps the 'auto' policy of that dtype)"
        )
    return choice


def resolve_policy(precision: Precision, dtype: torch.dtype | None, checkpoint_dtype: torch.dtype) -> PrecisionPolicy:
    """The policy of a checked request, given the dtype the checkpoint's weights are stored in (a rank reads it)."""
    compute = dtype if dtype is not None else checkpoint_dtype
    if precision is Precision.AUTO:
        if compute not in _AUTO:
            raise ValueError(f"no precision policy computes in {compute}; give dtype='bfloat16' or 'float32'")
        precision = _AUTO[compute]
    saved = dtype if dtype is not None else checkpoint_dtype
    return PrecisionPolicy(precision, _MASTER[precision], _COMPUTE[precision], saved)


def _parse(precision: Precision | str | None) -> Precision:
    if precision is None:
        return Precision.AUTO
    try:
        return Precision(precision)
    except ValueError:
        choices = ", ".join(repr(p.value) for p in Precision if p is not Precision.FP16)
        raise ValueError(
            f"precision={precision!r} is not a precision policy; use one of {choices} (or 'fp16' for inference)"
        ) from None


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
