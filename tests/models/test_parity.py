"""raymoe's models against transformers 5.23 on tiny random checkpoints (CPU, fp32).

Forward logits, one AdamW training step (loss and every updated weight) and greedy generation
must agree. The checkpoint each test loads was written by transformers' ``save_pretrained``.
"""

from __future__ import annotations

import pytest
import torch

from raymoe.checkpoint import load_model
from raymoe.models import causal_lm_loss
from raymoe.models.common.generation import generate
from raymoe.models.moe import GroupedExperts, select_gemm_backend

LOGITS_ATOL = 1e-5
STEP_RTOL = 1e-5


def _batch(vocab: int, batch: int = 3, seq: int = 13, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=generator)


def test_logits_match_transformers(tiny_name, tiny_checkpoint, load_hf_model):
    directory = tiny_checkpoint(tiny_name)
    ours, reference = load_model(directory), load_hf_model(directory)
    input_ids = _batch(ours.config.vocab_size)
    with torch.no_grad():
        expected = reference(input_ids).logits
        actual = ours(input_ids)
    assert actual.shape == expected.shape
    assert (actual - expected).abs().max().item() <= LOGITS_ATOL
    assert expected.std().item() > 1e-2  # a dead model would match trivially


def test_adamw_step_matches_transformers(tiny_name, tiny_checkpoint, load_hf_model, in_raymoe_layout):
    directory = tiny_checkpoint(tiny_name)
    ours, reference = load_model(directory).train(), load_hf_model(directory).train()
    before = {name: param.detach().clone() for name, param in ours.named_parameters()}
    input_ids = _batch(ours.config.vocab_size)
    labels = input_ids.clone()
    labels[0, :4] = -100  # an ignored prompt

    expected_loss = reference(input_ids, labels=labels).loss
    expected_loss.backward()
    actual_loss = causal_lm_loss(ours(input_ids), labels)
    actual_loss.backward()
    assert actual_loss.item() == pytest.approx(expected_loss.item(), rel=STEP_RTOL)

    reference_params = dict(reference.named_parameters())
    model_type = ours.model_type
    # A selection bias (e_score_correction_bias) is a buffer in transformers and no trained parameter here.
    trained = [(name, param) for name, param in ours.named_parameters() if param.requires_grad]
    for name, param in trained:
        want = in_raymoe_layout(model_type, name, reference_params[name].grad)
        rel = ((param.grad - want).norm() / want.norm().clamp_min(1e-12)).item()
        assert rel <= STEP_RTOL, f"{name}: gradient relative difference {rel:.2e}"

    # AdamW's first step is about lr * g / (|g| + eps) per element, so an element with |g| below eps moves by
    # lr / eps times its gradient's rounding noise (~1e-9 in fp32 here). With torch's eps=1e-8 the key biases'
    # near-zero gradients make that a visible step; even eps=1e-6 let one q_proj element of GLM-4.5 (|g| < 1e-6)
    # move the weight 1.3e-5 (relative) apart on some CPUs, while its gradient agreed within 3e-7. eps=1e-4
    # keeps the step a smooth function of the gradient (noise x 100), and the comparison about the layout.
    for model in (ours, reference):
        torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-4).step()
    for name, param in trained:
        expected = in_raymoe_layout(model_type, name, reference_params[name].detach())
        assert not torch.equal(param, before[name]), f"{name} did not move"
        rel = ((param.detach() - expected).norm() / expected.norm()).item()
        assert rel <= STEP_RTOL, f"{name}: relative difference {rel:.2e}"


def test_greedy_generation_matches_transformers(tiny_name, tiny_checkpoint, load_hf_model):
    directory = tiny_checkpoint(tiny_name)
    ours, reference = load_model(directory), load_hf_model(directory)
    prompts = _batch(ours.config.vocab_size, batch=2, seq=5, seed=3)
    expected = reference.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=12, do_sample=False)
    actual = generate(ours, prompts, max_new_tokens=12)
    assert torch.equal(actual, expected)


@pytest.mark.parametrize("backend", ["padded", "grouped_mm"])
def test_each_gemm_backend_matches_transformers(moe_name, backend, tiny_checkpoint, load_hf_model):
    directory = tiny_checkpoint(moe_name)
    ours, reference = load_model(directory), load_hf_model(directory)
    experts = [module for module in ours.modules() if isinstance(module, GroupedExperts)]
    if backend == "grouped_mm":
        weights = [w for e in experts for w in (e.gate_up_proj, e.down_proj)]
        if any(select_gemm_backend(torch.zeros(1, w.shape[2]), w) != "grouped_mm" for w in weights):
            pytest.skip("torch._grouped_mm refuses these shapes on CPU; the padded backend serves them")
    for module in experts:
        module.gemm_backend = backend
    input_ids = _batch(ours.config.vocab_size)
    with torch.no_grad():
        assert (ours(input_ids) - reference(input_ids).logits).abs().max().item() <= LOGITS_ATOL
