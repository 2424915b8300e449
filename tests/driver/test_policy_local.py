"""Policy losses of ``train_step`` on one rank against a one-process reference written in plain torch (transformers'
model, the losses spelled out here): loss, statistics and the weights after one AdamW step."""

from __future__ import annotations

import copy

import pytest
import torch

NAME = "moe_e8_k2_mha"
LR = 1e-2


CASES = [
    ("ppo", "token-mean", {}),
    ("ppo", "sequence-mean", {"clip_high": 0.28, "kl_coef": 0.1}),
    ("ppo", "token-sum-norm", {"clip_c": 3.0, "max_new_tokens": 6}),
    ("importance_sampling", "token-mean", {"kl_coef": 0.05}),
]


@pytest.mark.parametrize(("kind", "aggregation", "options"), CASES)
@pytest.mark.parametrize("micro_batches", [1, 2])
def test_policy_loss_step_equals_plain_torch(
    kind, aggregation, options, micro_batches, tiny_checkpoint, load_local, load_hf_model, plain_rl
):
    ckpt = tiny_checkpoint(NAME)
    hf = load_hf_model(ckpt)
    model = load_local(ckpt)
    model.configure_training(lr=LR, weight_decay=0.0, max_grad_norm=None, balance="none")
    ids, mask, adv = plain_rl.rollout(model.model_config.vocab_size)
    with torch.no_grad():
        base = plain_rl.logprobs(hf, ids)
    old = base + 0.3 * torch.randn(base.shape, generator=torch.Generator().manual_seed(5))  # ratios away from 1
    ref = base - 0.2
    got = model.train_step(
        ids,
        loss=kind,
        advantages=adv,
        old_logprobs=old,
        ref_logprobs=ref,
        loss_mask=mask,
        micro_batches=micro_batches,
        loss_aggregation=aggregation,
        **options,
    )
    reference = copy.deepcopy(hf).train()
    optimizer = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=0.0)
    loss = plain_rl.loss(plain_rl.logprobs(reference, ids), old, adv, ref, mask, kind, aggregation, **options)
    loss.backward()
    norm = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters() if p.grad is not None])
    optimizer.step()
    assert got["loss"] == pytest.approx(loss.item(), rel=1e-5, abs=1e-6)
    assert got["grad_norm"] == pytest.approx(norm.item(), rel=1e-4)
    assert got["num_tokens"] == int(mask.sum())
    with torch.no_grad():
        torch.testing.assert_close(model(ids), reference.eval()(input_ids=ids).logits, atol=2e-5, rtol=1e-4)


def test_a_callable_loss_is_normalised_over_the_global_batch(tiny_checkpoint, load_local, load_hf_model, plain_rl):
    ckpt = tiny_checkpoint(NAME)
    hf = load_hf_model(ckpt)
    model = load_local(ckpt)
    model.configure_training(lr=LR, weight_decay=0.0, max_grad_norm=None, balance="none")
    ids, mask, adv = plain_rl.rollout(model.model_config.vocab_size)

    def reinforce(logprobs, fields):
        m = fields["loss_mask"]
        return -(logprobs * fields["advantages"] * m).sum(), m.sum()

    got = model.train_step(ids, loss=reinforce, advantages=adv, loss_mask=mask, micro_batches=2)
    reference = copy.deepcopy(hf).train()
    lp = plain_rl.logprobs(reference, ids)
    loss = -(lp * adv * mask).sum() / mask.sum()
    loss.backward()
    norm = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters() if p.grad is not None])
    assert got["loss"] == pytest.approx(loss.item(), rel=1e-5)
    assert got["grad_norm"] == pytest.approx(norm.item(), rel=1e-4)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"loss": "ppo"}, "needs advantages"),
        ({"loss": "ppo", "advantages": "ADV"}, "needs old_logprobs"),
        ({"loss": "ppo", "advantages": "ADV", "old_logprobs": "ADV", "kl_coef": 0.1}, "needs ref_logprobs"),
        ({"loss": "ppo", "advantages": torch.zeros(2, 3), "old_logprobs": "ADV"}, "advantages must be a tensor"),
        ({"loss": "ppo", "advantages": "ADV", "old_logprobs": "ADV", "clip_low": 1.5}, "clip_low=1.5"),
        ({"loss": "ppo", "advantages": "ADV", "old_logprobs": "ADV", "loss_aggregation": "mean"}, "loss_aggregation"),
        (
            {"loss": "ppo", "advantages": "ADV", "old_logprobs": "ADV", "loss_aggregation": "token-sum-norm"},
            "max_new_tokens",
        ),
        ({"loss": "ppo", "advantages": "ADV", "old_logprobs": "ADV", "bogus": 1}, "unknown option"),
        ({"loss": "dpo"}, "loss='dpo'"),
        ({"advantages": "ADV"}, "inputs of a policy loss"),
        ({"routed_experts": torch.zeros(4, 8, 1, 2, dtype=torch.int16)}, "routed_experts has shape"),
        ({"routed_experts": "BIG"}, "expert ids in [0, 8)"),
    ],
)
def test_bad_policy_inputs_are_one_value_error(kwargs, message, tiny_checkpoint, load_local, plain_rl):
    model = load_local(tiny_checkpoint(NAME))
    model.configure_training(balance="none")
    ids, _, adv = plain_rl.rollout(model.model_config.vocab_size)
    slots = len(model.model_config.sparse_slots())
    swap = {"ADV": adv, "BIG": torch.full((4, 8, slots, 2), 8, dtype=torch.int16)}
    kwargs = {k: swap.get(v, v) if isinstance(v, str) and v in swap else v for k, v in kwargs.items()}
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        model.train_step(ids, **kwargs)
    assert model.step == 0
