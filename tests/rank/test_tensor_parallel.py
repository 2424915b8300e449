"""Tensor parallelism through raymoe.from_pretrained: sharded loading, logits, generation, gradients and
training equal one process (transformers) for a dense model and for Qwen3-MoE with TP experts."""

import copy
import sys

import pytest
import torch
from ray import cloudpickle

import raymoe
from raymoe.models.common.loss import causal_lm_loss

cloudpickle.register_pickle_by_value(sys.modules[__name__])

# Adam turns each gradient element into a step of about lr whatever its size, so the tiny
# reduction-order differences of small elements reach the weights; lr stays small beside them.
LR, WEIGHT_DECAY = 1e-3, 0.1
CASES = [("llama_mha4", 2), ("llama_mha4", 4), ("moe_e8_k2_mha", 2), ("moe_e8_k2_mha", 4)]


def rel_error(actual, expected):
    return (torch.linalg.vector_norm(actual - expected) / torch.linalg.vector_norm(expected).clamp_min(1e-12)).item()


def full_gradients(ctx, input_ids):
    """Every parameter's gradient of the mean loss on ``input_ids``, gathered whole (rank 0 answers)."""
    model = ctx.require_model().model
    model.zero_grad()
    causal_lm_loss(model(input_ids), input_ids).backward()
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad
        grads[name] = grad.detach().cpu()
    model.zero_grad()
    return grads if ctx.rank == 0 else None


def sharded_and_replicated_bytes(plans, hf_model):
    """Checkpoint bytes under a TP rule, and bytes of parameters no TP rule covers (read whole by every rank)."""
    sharded = replicated = 0
    for name, param in hf_model.state_dict().items():
        covered = any(name == path or name.startswith(path + ".") for path in plans.tp_rules)
        nbytes = param.numel() * param.element_size()
        sharded, replicated = (sharded + nbytes, replicated) if covered else (sharded, replicated + nbytes)
    return sharded, replicated


@pytest.mark.parametrize(("name", "tp"), CASES, ids=[f"{n}-tp{t}" for n, t in CASES])
def test_tensor_parallel_equals_one_process(load_on_world, tiny_checkpoint, load_hf_model, name, tp, tmp_path):
    directory = tiny_checkpoint(name)
    hf_model = load_hf_model(directory)
    gen = torch.Generator().manual_seed(tp)
    ids = torch.randint(0, hf_model.config.vocab_size, (3, 9), generator=gen)

    with load_on_world(directory, {"tp_size": tp}) as model:
        # sharded loading: each rank read exactly what it holds, about 1/tp of the sharded tensors
        sharded, replicated = sharded_and_replicated_bytes(model.plans, hf_model)
        for report in model.load_reports:
            assert report.bytes_read == report.bytes_held
            assert report.bytes_read <= sharded / tp * 1.10 + replicated, report
        assert sharded > 4 * replicated  # the bound above is meaningful

        with torch.no_grad():
            assert (model(ids) - hf_model(input_ids=ids).logits).abs().max().item() <= 1e-5

        expected_tokens = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
        assert torch.equal(model.generate(ids, max_new_tokens=8), expected_tokens)

        reference = copy.deepcopy(hf_model).train()
        reference(input_ids=ids, labels=ids).loss.backward()
        grads = model.run_on_ranks(full_gradients, ids)[0]
        for param_name, param in reference.named_parameters():
            assert rel_error(grads[param_name], param.grad) <= 1e-5, param_name

        reference.zero_grad()
        optimizer = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
        model.configure_training(lr=LR, weight_decay=WEIGHT_DECAY, betas=(0.9, 0.999), max_grad_norm=0.5)
        for step in range(2):
            batch = torch.randint(0, hf_model.config.vocab_size, (2, 7), generator=gen)
            loss = reference(input_ids=batch, labels=batch).loss
            loss.backward()
            expected_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
            optimizer.step()
            optimizer.zero_grad()
            metrics = model.train_step(batch)
            assert abs(metrics["loss"] - loss.item()) <= 1e-5 * loss.item(), step
            assert abs(metrics["grad_norm"] - expected_norm.item()) <= 1e-5 * expected_norm.item(), step

        model.save_pretrained(tmp_path)
        trained = dict(load_hf_model(tmp_path).named_parameters())
        for param_name, param in reference.named_parameters():
            assert rel_error(trained[param_name], param.detach()) <= 1e-5, param_name


def test_a_layout_that_splits_heads_fails_on_the_driver(ray_session, tiny_checkpoint):
    with pytest.raises(ValueError, match=r"k_proj' -> 'colwise' .*in blocks of 8 .*does not split into 4"):
        raymoe.from_pretrained(tiny_checkpoint("moe_e5_k3_gqa2_dense_mid"), distributed_config={"tp_size": 4})
