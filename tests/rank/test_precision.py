"""The precision policy on a rank (raymoe.spec.precision, issue 36): from a bf16 checkpoint the default holds float32
master weights and AdamW states and computes in bf16, so small updates survive; pure bf16, asked for, loses them;
a router's selection bias stays float32 and moves; checkpoints are written in the checkpoint's dtype.

Mostly one rank in the test's process (``load_local``): a mixed policy wraps even a world of one in FSDP2 for its
casts; the last test trains other layouts on Ray.
"""

from __future__ import annotations

import json
import sys
import warnings

import pytest
import torch
from ray import cloudpickle

cloudpickle.register_pickle_by_value(sys.modules[__name__])

MOE = "moe_e8_k2_mha"
DEEPSEEK = "deepseekv3_e8_k2_qproj_bias"
STEPS, LR = 20, 1e-5


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory, make_hf_model):
    """``bf16_checkpoint(name)``: a tiny transformers checkpoint saved in bf16, as hub MoE checkpoints are."""
    made = {}

    def get(name):
        if name not in made:
            made[name] = tmp_path_factory.mktemp(f"{name}-bf16")
            make_hf_model(name).to(torch.bfloat16).save_pretrained(made[name])
        return made[name]

    return get


def held_parameters(ctx) -> dict[str, torch.Tensor]:
    """Every trainable parameter of the rank's model as held (the master copy), in full."""
    from torch.distributed.tensor import DTensor

    return {
        name: (param.full_tensor() if isinstance(param, DTensor) else param).detach().clone()
        for part in ctx.require_model().parts
        for name, param in part.named_parameters()
        if param.requires_grad
    }


def train(model, batches) -> list[float]:
    model.configure_training(lr=LR, weight_decay=0.0, max_grad_norm=None)
    return [model.train_step(ids, attention_mask=mask)["loss"] for ids, mask in batches]


def changed_fraction(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> float:
    changed = sum(int((after[name] != value).sum()) for name, value in before.items())
    return changed / sum(value.numel() for value in before.values())


def run(load_local, checkpoint, batches, **kwargs) -> tuple[list[float], float, object]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with load_local(checkpoint, **kwargs) as model:
            before = model.run_on_ranks(held_parameters)[0]
            losses = train(model, batches)
            after = model.run_on_ranks(held_parameters)[0]
            return losses, changed_fraction(before, after), model.precision


def test_the_default_keeps_small_updates_of_a_bf16_checkpoint_and_pure_bf16_loses_them(
    load_local, bf16_checkpoint, padded_batches
):
    checkpoint = bf16_checkpoint(MOE)
    batches = padded_batches(96, steps=STEPS, rows=8, seq=12)
    mixed_losses, mixed_changed, mixed = run(load_local, checkpoint, batches)
    fp32_losses, _, fp32 = run(load_local, checkpoint, batches, precision="fp32")
    _, pure_changed, pure = run(load_local, checkpoint, batches, precision="bf16-pure")
    assert (mixed.master, mixed.compute) == (torch.float32, torch.bfloat16)
    assert (fp32.master, fp32.compute) == (torch.float32, torch.float32)
    assert (pure.master, pure.compute) == (torch.bfloat16, torch.bfloat16)
    assert mixed_changed >= 0.99, mixed_changed
    for step, (got, want) in enumerate(zip(mixed_losses, fp32_losses, strict=True)):
        assert abs(got - want) <= 1e-3 * abs(want), (step, got, want)
    # the twin: the same run with bf16 masters rounds most of these updates away
    assert pure_changed < 0.5, pure_changed


def test_pure_bf16_training_warns_and_fp16_training_is_refused(load_local, bf16_checkpoint):
    with (
        load_local(bf16_checkpoint(MOE), precision="bf16-pure") as model,
        pytest.warns(UserWarning, match="bf16-pure.*updates below"),
    ):
        model.configure_training(lr=LR)
    with load_local(bf16_checkpoint(MOE), dtype="float16") as model:
        assert model.precision.precision.value == "fp16"
        with pytest.raises(ValueError, match="'fp16' cannot train: float16 needs dynamic loss scaling"):
            model.configure_training(lr=LR)


def selection_biases(ctx) -> list[torch.Tensor]:
    from torch.distributed.tensor import DTensor

    biases = [
        module.e_score_correction_bias
        for module in ctx.require_model().model.modules()
        if getattr(module, "e_score_correction_bias", None) is not None
    ]
    return [(b.full_tensor() if isinstance(b, DTensor) else b).detach().clone() for b in biases]


@pytest.mark.parametrize("precision", [None, "bf16-pure"], ids=["default", "bf16-pure"])
def test_a_routers_selection_bias_stays_float32_and_moves(load_local, bf16_checkpoint, padded_batches, precision):
    batches = padded_batches(96, steps=3, rows=8, seq=12)
    with load_local(bf16_checkpoint(DEEPSEEK), precision=precision) as model:
        before = model.run_on_ranks(selection_biases)[0]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model.configure_training(lr=LR, balance="bias", bias_update_rate=1e-3)
        for ids, mask in batches:
            model.train_step(ids, attention_mask=mask)
        after = model.run_on_ranks(selection_biases)[0]
    assert before and all(b.dtype == torch.float32 for b in before + after)
    # each step moves every entry by exactly +-rate or 0 (bias balancing), which bf16 would round on a bias ~0.05
    for b0, b1 in zip(before, after, strict=True):
        steps = (b1 - b0) / 1e-3
        assert (steps - steps.round()).abs().max() < 1e-3 and steps.abs().max() >= 1


def test_save_pretrained_writes_the_checkpoints_dtype_not_the_masters(load_local, bf16_checkpoint, tmp_path):
    from safetensors import safe_open

    with load_local(bf16_checkpoint(DEEPSEEK)) as model:
        assert model.precision.master == torch.float32
        assert "precision bf16-mixed: float32 weights" in model.describe()
        model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    dtypes = {}
    for file in tmp_path.glob("*.safetensors"):
        with safe_open(file, "pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open has no iterator)
                dtypes[name] = handle.get_slice(name).get_dtype()
    biases = {name for name in dtypes if name.endswith("e_score_correction_bias")}
    assert biases and {dtypes[name] for name in biases} == {"F32"}  # as transformers keeps it
    assert {dtype for name, dtype in dtypes.items() if name not in biases} == {"BF16"}


def test_cpu_offload_with_bias_balancing_moves_the_bias(load_local, bf16_checkpoint, padded_batches):
    """``fsdp_cpu_offload``: the router's shard lives on the host, the step's load on the device (the same memory
    here, on CPU); the bias step is cut on the device and added where the shard lives."""
    batches = padded_batches(96, steps=2, rows=8, seq=12)
    with load_local(bf16_checkpoint(DEEPSEEK), {"fsdp_cpu_offload": True}) as model:
        before = model.run_on_ranks(selection_biases)[0]
        model.configure_training(lr=LR, balance="bias", bias_update_rate=1e-3)
        for ids, mask in batches:
            model.train_step(ids, attention_mask=mask)
        after = model.run_on_ranks(selection_biases)[0]
    assert all(b.dtype == torch.float32 for b in after)
    assert max(float((b1 - b0).abs().max()) for b0, b1 in zip(before, after, strict=True)) >= 1e-3 * 0.99


@pytest.mark.parametrize(
    "layout",
    [{"tp_size": 2}, {"pp_size": 2}, {"fsdp_size": 2, "ep_size": 2}],
    ids=["tp2", "pp2", "fsdp2-ep2"],  # without data parallelism (FSDP2 over one rank), a pipeline, token dispatch
)
def test_every_layout_trains_a_bf16_checkpoint_with_float32_masters(
    load_on_world, load_local, bf16_checkpoint, padded_batches, layout
):
    checkpoint = bf16_checkpoint(MOE)
    batches = padded_batches(96, steps=3, rows=8, seq=12)
    with load_local(checkpoint, precision="fp32") as model:
        want = train(model, batches)
    with load_on_world(checkpoint, layout) as model:
        assert (model.precision.master, model.precision.compute) == (torch.float32, torch.bfloat16)
        before = model.run_on_ranks(held_parameters)
        got = train(model, batches)
        after = model.run_on_ranks(held_parameters)
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert abs(g - w) <= 1e-3 * abs(w), (step, g, w)
    # the embedding rows of tokens three steps never saw have no gradient (and no decay here): left out
    trained = [{name: value for name, value in b.items() if "embed_tokens" not in name} for b in before]
    changed = [changed_fraction(b, a) for b, a in zip(trained, after, strict=True) if b]
    assert changed and min(changed) >= 0.99, changed
