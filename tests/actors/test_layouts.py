"""Every layout trains exactly like one process (issue 6): three AdamW steps on a tiny Qwen3-MoE give the
losses and, gathered, the weights of transformers in one process; the saved checkpoint loads in transformers
and gives the handle's logits."""

import copy

import pytest
import torch

import raymoe
from raymoe import DistributedConfig

MOE = "moe_e8_k2_mha"  # 8 experts, top-2, 4 heads and 4 kv heads: splits 4 ways on every axis
LR, WEIGHT_DECAY, STEPS, ROWS, SEQ = 1e-3, 0.1, 3, 8, 10
MASKED = {"model.layers.*.mlp.gate": "ep_router", "model.layers.*.mlp.experts": "moe_tp_experts"}

LAYOUTS = {
    "tp2-fsdp2": {"tp_size": 2, "fsdp_size": 2},
    "fsdp4": {"fsdp_size": 4},
    "dp_replicate2-fsdp2": {"dp_replicate_size": 2, "fsdp_size": 2},
    "dp_replicate2-tp2": {"dp_replicate_size": 2, "tp_size": 2},
}


def rel_error(actual, expected):
    return (torch.linalg.vector_norm(actual - expected) / torch.linalg.vector_norm(expected).clamp_min(1e-12)).item()


def global_batches(vocab, seed=0):
    """Right-padded global batches whose rows hold different numbers of tokens (uneven per rank)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for step in range(STEPS):
        ids = torch.randint(0, vocab, (ROWS, SEQ), generator=gen)
        mask = torch.ones_like(ids)
        for row in range(ROWS):
            pad = (row * 3 + step) % (SEQ - 2)
            if pad:
                mask[row, -pad:] = 0
        out.append((ids, mask))
    return out


def reference_training(hf_model, data):
    model = copy.deepcopy(hf_model).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    losses = []
    for ids, mask in data:
        loss = model(input_ids=ids, labels=ids.masked_fill(mask == 0, -100)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, model


def check_layout(config, tiny_checkpoint, load_hf_model, tmp_path, checkpoint=MOE, micro_batches=1):
    directory = tiny_checkpoint(checkpoint) if isinstance(checkpoint, str) else checkpoint
    hf_model = load_hf_model(directory)
    data = global_batches(hf_model.config.vocab_size)
    ref_losses, ref_model = reference_training(hf_model, data)
    with raymoe.from_pretrained(directory, distributed_config=DistributedConfig(**config)) as model:
        model.configure_training(lr=LR, weight_decay=WEIGHT_DECAY)
        metrics = [model.train_step(ids, attention_mask=mask, micro_batches=micro_batches) for ids, mask in data]
        for step, (got, want) in enumerate(zip(metrics, ref_losses, strict=True)):
            assert abs(got["loss"] - want) <= 1e-5 * abs(want), (step, got["loss"], want)
        model.save_pretrained(tmp_path)
        trained = load_hf_model(tmp_path)
        reference = dict(ref_model.named_parameters())
        for name, param in trained.named_parameters():
            assert rel_error(param, reference[name].detach()) <= 1e-5, name
        ids = data[0][0]
        with torch.no_grad():
            assert (model(ids) - trained(input_ids=ids).logits).abs().max().item() <= 1e-5
    return metrics


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_trains_like_one_process(ray_session, tiny_checkpoint, load_hf_model, tmp_path, layout):
    metrics = check_layout(LAYOUTS[layout], tiny_checkpoint, load_hf_model, tmp_path)
    assert all(m["num_tokens"] > 0 and m["grad_norm"] > 0 for m in metrics)


def test_gradient_accumulation_equals_one_big_step(ray_session, tiny_checkpoint, load_hf_model, tmp_path):
    check_layout({"fsdp_size": 2, "tp_size": 2}, tiny_checkpoint, load_hf_model, tmp_path, micro_batches=2)
