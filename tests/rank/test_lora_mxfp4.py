"""LoRA on gpt-oss with its MXFP4 experts kept packed (issue 30): ``quantized_experts="mxfp4"``.

The checkpoint (``gpt_oss_mxfp4_checkpoint``) stores experts as hub gpt-oss does (uint8 blocks + scales) with
weights MXFP4 holds exactly, so the packed model must train like the same model loaded dequantized: equal losses,
gradient norms and adapters, under one rank and under layouts that split the packed tensors over ep, efsdp and tp.
"""

import pytest
import torch
from safetensors.torch import load_file

from raymoe.spec.launch import prepare_launch

LORA = {
    "r": 4,
    "lora_alpha": 8,
    "target_modules": ["q_proj", "o_proj"],
    "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
    "init_lora_weights": False,
}
STEPS = 3


def _train(model, batches) -> list[float]:
    model.configure_training(lr=1e-3, weight_decay=0.1, max_grad_norm=None, balance="none")
    results = [model.train_step(ids, attention_mask=mask) for ids, mask in batches]
    return [value for got in results for value in (got["loss"], got["grad_norm"])]


def expert_tensors(ctx) -> dict[str, tuple[str, int]]:
    """``{name: (dtype, local bytes)}`` of every expert parameter this rank holds."""
    from torch.distributed.tensor import DTensor

    held = {}
    for name, param in ctx.require_model().model.named_parameters():
        if ".experts." in name and "lora" not in name:
            local = param.to_local() if isinstance(param, DTensor) else param
            held[name.rpartition(".experts.")[2]] = (str(local.dtype), local.numel() * local.element_size())
    return held


def _reference(load_local, quantized, batches, tmp_path):
    """The same LoRA run on the experts loaded dequantized (float32, as the checkpoint's other weights)."""
    with load_local(quantized, lora=LORA) as model:
        losses = _train(model, batches)
        model.save_adapter(tmp_path / "dequantized")
        model.save_pretrained(tmp_path / "dequantized-merged")
    return losses


def test_packed_experts_train_like_the_dequantized_model(
    load_local, gpt_oss_mxfp4_checkpoint, padded_batches, tmp_path
):
    _, quantized = gpt_oss_mxfp4_checkpoint
    batches = padded_batches(96, steps=STEPS, rows=4, seq=8)
    want = _reference(load_local, quantized, batches, tmp_path)
    with load_local(quantized, lora=LORA, quantized_experts="mxfp4") as model:
        held = model.run_on_ranks(expert_tensors)[0]
        got = _train(model, batches)
        model.save_adapter(tmp_path / "packed")
        model.save_pretrained(tmp_path / "packed-merged")
    assert got == pytest.approx(want, rel=1e-6)
    # held packed: uint8 blocks and scales in place of the weights, 17/64 of their bf16 bytes
    assert {name for name in held if name.endswith(("gate_up_proj", "down_proj"))} == set()
    for weight in ("gate_up_proj", "down_proj"):
        assert held[f"{weight}_blocks"][0] == held[f"{weight}_scales"][0] == "torch.uint8"
        packed_bytes = held[f"{weight}_blocks"][1] + held[f"{weight}_scales"][1]
        bf16_bytes = 2 * 32 * held[f"{weight}_scales"][1]  # 32 weights per scale byte
        assert packed_bytes / bf16_bytes == pytest.approx(17 / 64) and packed_bytes / bf16_bytes <= 0.28
    for kind in ("", "-merged"):
        packed = {k: v for f in (tmp_path / f"packed{kind}").glob("*.safetensors") for k, v in load_file(f).items()}
        plain = {k: v for f in (tmp_path / f"dequantized{kind}").glob("*.safetensors") for k, v in load_file(f).items()}
        assert packed.keys() == plain.keys()
        for key in plain:
            torch.testing.assert_close(packed[key], plain[key], rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.ray
@pytest.mark.parametrize(
    "layout",
    [{"fsdp_size": 2, "ep_size": 2}, {"tp_size": 2, "fsdp_size": 2, "ep_size": 2}, {"fsdp_size": 4, "ep_size": 2}],
    ids=["fsdp2-ep2", "tp2-fsdp2-ep2", "fsdp4-ep2-efsdp2"],
)
def test_packed_experts_train_alike_on_every_layout(
    load_local, load_on_world, gpt_oss_mxfp4_checkpoint, padded_batches, tmp_path, layout
):
    _, quantized = gpt_oss_mxfp4_checkpoint
    batches = padded_batches(96, steps=STEPS, rows=4, seq=8)
    want = _reference(load_local, quantized, batches, tmp_path)
    with load_on_world(quantized, layout, lora=LORA, quantized_experts="mxfp4") as model:
        assert all(held["down_proj_blocks"][0] == "torch.uint8" for held in model.run_on_ranks(expert_tensors))
        got = _train(model, batches)
    assert got == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize(
    ("which", "kwargs", "message"),
    [
        ("quantized", {"quantized_experts": "mxfp4"}, r"only a frozen base allows: pass lora="),
        ("quantized", {"quantized_experts": "nf4", "lora": LORA}, r"quantized_experts='nf4': the packed formats"),
        ("plain", {"quantized_experts": "mxfp4", "lora": LORA}, r"quant_method=None; only a checkpoint storing"),
        (
            "quantized",
            {"quantized_experts": "mxfp4", "lora": LORA, "distributed_config": {"tp_size": 2}},
            r"down_proj \(4, 64, 32\) is split 2 ways along its input features, which MXFP4 packs in 1 groups",
        ),
    ],
    ids=["without-lora", "unknown-format", "unquantized-checkpoint", "a-split-group"],
)
def test_bad_requests_are_refused(gpt_oss_mxfp4_checkpoint, which, kwargs, message):
    plain, quantized = gpt_oss_mxfp4_checkpoint
    directory = quantized if which == "quantized" else plain
    kwargs = dict(kwargs)
    config = kwargs.pop("distributed_config", {})
    with pytest.raises(ValueError, match=message):
        prepare_launch(directory, config, **kwargs)


def test_a_packed_run_resumes_on_the_dequantized_base(load_local, gpt_oss_mxfp4_checkpoint, padded_batches, tmp_path):
    """The state holds the adapters, not the packed bytes: a packed run's state resumes where the experts are held
    dequantized (and the losses go on as in one uninterrupted run)."""
    _, quantized = gpt_oss_mxfp4_checkpoint
    batches = padded_batches(96, steps=STEPS, rows=4, seq=8)
    with load_local(quantized, lora=LORA) as model:
        whole = _train(model, batches)
    with load_local(quantized, lora=LORA, quantized_experts="mxfp4") as model:
        first = _train(model, batches[:1])
        model.save_state(tmp_path / "state")
    with load_local(quantized, lora=LORA) as model:
        model.load_state(tmp_path / "state")
        rest = [v for ids, mask in batches[1:] for v in _step(model, ids, mask)]
    assert first + rest == pytest.approx(whole, rel=1e-6)


def _step(model, ids, mask) -> tuple[float, float]:
    got = model.train_step(ids, attention_mask=mask)
    return got["loss"], got["grad_norm"]
