"""Per-token log-probabilities, entropy and router replay on one rank (``logprobs``), against transformers."""

from __future__ import annotations

import pytest
import torch

FAMILIES = ["moe_e8_k2_mha", "gptoss_e4_k3_gqa2_window5", "deepseekv3_e8_k3_groups_qlora_yarn"]


def reference_logprobs(hf_model, ids, mask=None, temperature=1.0):
    logits = hf_model(input_ids=ids, attention_mask=mask).logits.float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    out = torch.zeros(ids.shape)
    out[:, 1:] = logp[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    probs = logp.exp()
    entropy = torch.zeros(ids.shape)
    entropy[:, 1:] = -(probs * logp).sum(-1)[:, :-1]
    return out, entropy


@pytest.mark.parametrize("name", FAMILIES)
def test_logprobs_and_entropy_equal_transformers(name, tiny_checkpoint, load_local, load_hf_model):
    ckpt = tiny_checkpoint(name)
    hf = load_hf_model(ckpt)
    model = load_local(ckpt)
    ids = torch.randint(0, model.model_config.vocab_size, (3, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref, ref_entropy = reference_logprobs(hf, ids, temperature=0.7)
    got = model.logprobs(ids, temperature=0.7, return_entropy=True)
    torch.testing.assert_close(got.logprobs, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.entropy, ref_entropy, atol=1e-5, rtol=1e-5)
    assert got.logprobs.dtype == torch.float32 and bool((got.logprobs[:, 0] == 0).all())


@pytest.mark.parametrize("name", FAMILIES)
def test_replaying_recorded_routes_reproduces_the_logprobs(name, tiny_checkpoint, load_local):
    model = load_local(tiny_checkpoint(name))
    ids = torch.randint(0, model.model_config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(2))
    first = model.logprobs(ids, return_routed_experts=True)
    moe = model.model_config.moe
    assert first.routed_experts.shape == (2, 7, len(model.model_config.sparse_slots()), moe.num_experts_per_tok)
    assert first.routed_experts.dtype == torch.int16
    again = model.logprobs(ids, routed_experts=first.routed_experts)
    assert torch.equal(again, first.logprobs)
    other = torch.randint(0, moe.num_experts, first.routed_experts.shape, generator=torch.Generator().manual_seed(3))
    forced = model.logprobs(ids, routed_experts=other.to(torch.int16))
    assert not torch.allclose(forced, first.logprobs)


@pytest.mark.parametrize("name", FAMILIES)
def test_generate_returns_the_routes_of_a_full_forward(name, tiny_checkpoint, load_local):
    model = load_local(tiny_checkpoint(name))
    prompts = torch.randint(1, model.model_config.vocab_size, (2, 4), generator=torch.Generator().manual_seed(4))
    tokens, routes = model.generate(prompts, 5, return_routed_experts=True, eos_token_ids=())
    full = model.logprobs(tokens, return_routed_experts=True).routed_experts
    assert routes.shape == full.shape
    assert torch.equal(routes, full)


def distinct_routes(shape, num_experts, seed):
    """``[B, S, L, K]`` int16: K distinct random experts per token and layer (what a top-k would give)."""
    g = torch.Generator().manual_seed(seed)
    rows, width, layers, k = shape
    scores = torch.rand(rows, width, layers, num_experts, generator=g)
    return scores.argsort(dim=-1)[..., :k].to(torch.int16)


@pytest.mark.parametrize("name", FAMILIES)
def test_forced_routes_equal_transformers_with_its_router_forced(
    name, tiny_checkpoint, load_local, load_hf_model, plain_rl
):
    ckpt = tiny_checkpoint(name)
    hf = load_hf_model(ckpt)
    model = load_local(ckpt)
    moe = model.model_config.moe
    ids = torch.randint(0, model.model_config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(6))
    shape = (2, 6, len(model.model_config.sparse_slots()), moe.num_experts_per_tok)
    routes = distinct_routes(shape, moe.num_experts, seed=7)
    with torch.no_grad(), plain_rl.forced(routes, moe.num_experts, moe.num_experts_per_tok):
        expected = plain_rl.logprobs(hf, ids)
    with torch.no_grad():
        free = plain_rl.logprobs(hf, ids)
    got = model.logprobs(ids, routed_experts=routes)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(got, free, atol=1e-4)  # the forcing changed the network


@pytest.mark.parametrize("name", FAMILIES)
def test_a_replayed_ppo_step_equals_transformers_forced(name, tiny_checkpoint, load_local, load_hf_model, plain_rl):
    import copy

    ckpt = tiny_checkpoint(name)
    hf = load_hf_model(ckpt)
    model = load_local(ckpt)
    model.configure_training(lr=1e-2, weight_decay=0.0, max_grad_norm=None, balance="none")
    moe = model.model_config.moe
    ids, mask, adv = plain_rl.rollout(model.model_config.vocab_size, rows=4, seq=7)
    shape = (4, 7, len(model.model_config.sparse_slots()), moe.num_experts_per_tok)
    routes = distinct_routes(shape, moe.num_experts, 8)
    forced = lambda: plain_rl.forced(routes, moe.num_experts, moe.num_experts_per_tok)  # noqa: E731
    with torch.no_grad(), forced():
        old = plain_rl.logprobs(hf, ids) - 0.1
    got = model.train_step(
        ids, loss="ppo", advantages=adv, old_logprobs=old, loss_mask=mask, routed_experts=routes, micro_batches=2
    )
    reference = copy.deepcopy(hf).train()
    with forced():
        loss = plain_rl.loss(plain_rl.logprobs(reference, ids), old, adv, None, mask, "ppo", "token-mean")
        loss.backward()
    norm = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters() if p.grad is not None])
    router_grads = [p.grad for n, p in reference.named_parameters() if n.endswith(("gate.weight", "router.weight"))]
    assert router_grads and all(g is not None and g.abs().sum() > 0 for g in router_grads)  # the router learns
    assert got["loss"] == pytest.approx(loss.item(), rel=1e-5, abs=1e-7)
    assert got["grad_norm"] == pytest.approx(norm.item(), rel=1e-4)


def test_left_padded_rows_score_their_real_tokens_as_alone(tiny_checkpoint, load_local):
    model = load_local(tiny_checkpoint(FAMILIES[0]))
    ids = torch.randint(1, model.model_config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(9))
    alone = model.logprobs(ids[1:, 2:])  # row 1's last 4 tokens on their own
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # row 1 left-padded by 2
    padded = model.logprobs(ids, mask)
    torch.testing.assert_close(padded[1, 2:], alone[0], atol=1e-5, rtol=1e-5)
    assert bool((padded[1, :3] == 0).all())  # padding and the first real token have no log-prob


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"routed_experts": torch.zeros(2, 5, 1, 2, dtype=torch.int16)}, r"routed_experts has shape \[2, 5, 1, 2\]"),
        ({"routed_experts": torch.full((2, 5, 2, 2), 8, dtype=torch.int16)}, r"expert ids in \[0, 8\)"),
        ({"routed_experts": torch.zeros(2, 5, 2, 2)}, "integer expert ids"),
        ({"temperature": 0}, "temperature=0"),
        ({"attention_mask": torch.ones(2, 4)}, "attention_mask must be a tensor shaped like input_ids"),
    ],
)
def test_bad_logprobs_inputs_are_one_value_error(kwargs, message, tiny_checkpoint, load_local):
    model = load_local(tiny_checkpoint(FAMILIES[0]))
    with pytest.raises(ValueError, match=message):
        model.logprobs(torch.zeros(2, 5, dtype=torch.int64), **kwargs)


def test_a_dense_model_has_no_routes(tiny_checkpoint, load_local):
    model = load_local(tiny_checkpoint("llama_mha4"))
    ids = torch.ones(1, 4, dtype=torch.int64)
    assert model.logprobs(ids).shape == (1, 4)
    with pytest.raises(ValueError, match="dense model"):
        model.logprobs(ids, return_routed_experts=True)
    with pytest.raises(ValueError, match="dense model"):
        model.generate(ids, 2, return_routed_experts=True)


def test_a_replayed_router_drops_no_pair_over_capacity():
    from raymoe.models.moe.router import TopKRouter

    router = TopKRouter(8, 4, 2, norm_topk_prob=True).train()
    torch.nn.init.normal_(router.weight)
    router.capacity_factor = 0.5  # drops pairs of its own choice
    hidden = torch.randn(12, 8)
    own_ids, _, _ = router(hidden, sequence_length=12)
    assert bool((own_ids < 0).any())
    forced = torch.tensor([[0, 1]] * 12)
    ids, weights, _ = router(hidden, sequence_length=12, forced_TK=forced)
    assert torch.equal(ids, forced)
    probs = torch.softmax(hidden @ router.weight.T, dim=-1)[:, :2]
    torch.testing.assert_close(weights, probs / probs.sum(-1, keepdim=True))
