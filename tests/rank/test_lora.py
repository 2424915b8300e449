"""LoRA adapters (issue 30) under one rank and 4-rank layouts equal PEFT on transformers in one process.

The reference: a PEFT adapter with random A and B (``init_lora_weights=False``, so B A != 0 from the start and
every factor gets a gradient) on the transformers model, saved; raymoe loads that directory (``lora=DIR``). Three
AdamW steps on both: losses and gradient norms within 1e-5, the saved adapter's tensors (PEFT's keys) within 1e-5 of
the reference's, PEFT loads raymoe's adapter with equal logits, and the merged checkpoint loads in transformers.
"""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

LR, WEIGHT_DECAY, STEPS, ROWS, SEQ = 1e-3, 0.1, 3, 8, 10
QWEN_EP = "moe_e8_k2_mha"  # 8 experts: split over ep 2 and 4
QWEN_DENSE_MID = "moe_e5_k3_gqa2_dense_mid"  # a dense MLP layer between sparse ones
GPT_OSS = "gptoss_e4_k3_gqa2_window5"
MIXTRAL = "mixtral_e8_k3_gqa2_window6"
DEEPSEEK = "deepseekv3_e8_k2_qproj_bias"
MASKED = {"model.layers.*.mlp.gate": "ep_router", "model.layers.*.mlp.experts": "moe_tp_experts"}
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
TARGETS = {
    QWEN_EP: ["q_proj", "v_proj", "o_proj"],
    # gate_proj / up_proj: transformers 4's expert modules, which PEFT (and raymoe) read as the fused gate_up_proj
    # at twice the rank and alpha; the dense middle layer's MLP is then not adapted
    QWEN_DENSE_MID: ["q_proj", "k_proj", "o_proj", "gate_proj", "up_proj"],
    GPT_OSS: ["q_proj", "o_proj"],
    MIXTRAL: ["k_proj", "o_proj"],
    DEEPSEEK: ["q_proj", "kv_b_proj", "o_proj"],
}
LAYOUTS = {
    "tp2": {"tp_size": 2},
    "fsdp4-ep4": {"fsdp_size": 4, "ep_size": 4},
    "tp4-ep4-masked": {"tp_size": 4, "ep_size": 4, "ep_plan": MASKED},
    "tp2-fsdp2-ep2": {"tp_size": 2, "fsdp_size": 2, "ep_size": 2},
    "pp2-fsdp2": {"pp_size": 2, "fsdp_size": 2},
    "dp_replicate2-fsdp2-ep2": {"dp_replicate_size": 2, "fsdp_size": 2, "ep_size": 2},
    # context parallelism (issue 32): adapters on a base whose every row is split over the cp ranks
    "cp2-fsdp2-ep4": {"cp_size": 2, "fsdp_size": 2, "ep_size": 4},
    "cp4": {"cp_size": 4},
}
CP_SEQ = 16  # a multiple of 2 * cp_size


def _peft_reference(name: str, directory: Path, adapter_dir: Path, load_hf_model, batches):
    """A random PEFT adapter saved to ``adapter_dir``, then AdamW steps on ``batches`` -> losses, norms, model."""
    import peft

    hf_model = load_hf_model(directory)
    torch.manual_seed(1)
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=TARGETS[name], target_parameters=EXPERTS, init_lora_weights=False
    )
    reference = peft.get_peft_model(hf_model, config)
    reference.save_pretrained(adapter_dir)
    reference.train()
    params = [p for p in reference.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)
    losses, norms = [], []
    for ids, mask in batches:
        loss = reference(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss
        loss.backward()
        norms.append(torch.nn.utils.get_total_norm([p.grad for p in params]).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, norms, reference.eval()


def _rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-12)).item()


def _check_training(name, config, load, tiny_checkpoint, load_hf_model, padded_batches, tmp_path: Path) -> None:
    import peft

    directory = tiny_checkpoint(name)
    seq = CP_SEQ if config.get("cp_size", 1) > 1 else SEQ
    batches = padded_batches(96, steps=STEPS, rows=ROWS, seq=seq)  # every tiny config has 96 tokens
    losses, norms, reference = _peft_reference(name, directory, tmp_path / "start", load_hf_model, batches)
    with load(directory, config, lora=str(tmp_path / "start")) as model:
        model.configure_training(lr=LR, weight_decay=WEIGHT_DECAY, betas=(0.9, 0.999), max_grad_norm=None)
        for step, (ids, mask) in enumerate(batches):
            got = model.train_step(ids, attention_mask=mask)
            assert abs(got["loss"] - losses[step]) <= 1e-5 * losses[step], (step, got["loss"], losses[step])
            assert abs(got["grad_norm"] - norms[step]) <= 1e-5 * norms[step], (step, got["grad_norm"], norms[step])
        model.save_adapter(tmp_path / "trained")
        model.save_pretrained(tmp_path / "merged")
        ids = batches[0][0]
        logits = model(ids)
    saved = load_file(tmp_path / "trained" / "adapter_model.safetensors")
    expected = {k: v for k, v in reference.state_dict().items() if "lora_" in k}
    expected = {k.replace(".default", ""): v for k, v in expected.items()}
    assert set(saved) == set(expected)
    for key, tensor in saved.items():
        assert _rel(tensor, expected[key]) <= 1e-5, key
    with torch.no_grad():
        reloaded = peft.PeftModel.from_pretrained(load_hf_model(directory), tmp_path / "trained")
        assert (reloaded(input_ids=ids).logits - logits).abs().max().item() <= 1e-5
        merged = load_hf_model(tmp_path / "merged")
        assert (merged(input_ids=ids).logits - logits).abs().max().item() <= 1e-5


@pytest.mark.parametrize("name", [QWEN_DENSE_MID, GPT_OSS])
def test_one_rank_training_equals_peft(name, load_local, tiny_checkpoint, load_hf_model, padded_batches, tmp_path):
    _check_training(name, {}, load_local, tiny_checkpoint, load_hf_model, padded_batches, tmp_path)


@pytest.mark.ray
@pytest.mark.parametrize(
    ("name", "layout_name"),
    [
        (QWEN_EP, "tp2"),
        (QWEN_EP, "fsdp4-ep4"),
        (QWEN_EP, "tp4-ep4-masked"),
        (QWEN_EP, "tp2-fsdp2-ep2"),
        (QWEN_EP, "pp2-fsdp2"),
        (QWEN_EP, "dp_replicate2-fsdp2-ep2"),
        (GPT_OSS, "tp2-fsdp2-ep2"),
        (MIXTRAL, "fsdp4-ep4"),
        (DEEPSEEK, "tp2-fsdp2-ep2"),
        (QWEN_EP, "cp2-fsdp2-ep4"),
        (GPT_OSS, "cp4"),
    ],
)
def test_layout_training_equals_peft(
    name, layout_name, load_on_world, tiny_checkpoint, load_hf_model, padded_batches, tmp_path
):
    _check_training(name, LAYOUTS[layout_name], load_on_world, tiny_checkpoint, load_hf_model, padded_batches, tmp_path)
