"""RL on 4-rank layouts (issue 31): log-probs and entropy, router replay and a replayed PPO step under TP
(vocabulary-parallel), FSDP, token dispatch, masked EP, data parallelism and a pipeline, each against a one-process
reference in plain torch on transformers (its routers forced to the same routes)."""

from __future__ import annotations

import copy
import sys

import pytest
import torch
from ray import cloudpickle

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the callable loss below runs on the ranks

MASKED = {"model.layers.*.mlp.gate": "ep_router", "model.layers.*.mlp.experts": "moe_tp_experts"}
QWEN = "moe_e8_k2_mha"
LAYOUTS = {
    "tp2-fsdp2": {"tp_size": 2, "fsdp_size": 2},
    "fsdp4-ep4": {"fsdp_size": 4, "ep_size": 4},  # token dispatch
    "tp4-ep4-masked": {"tp_size": 4, "ep_size": 4, "ep_plan": MASKED},
    "dp_replicate2-fsdp2-ep2": {"dp_replicate_size": 2, "fsdp_size": 2, "ep_size": 2},
    "pp2-tp2": {"pp_size": 2, "tp_size": 2},
    # context parallelism (issue 32): every row split over the cp ranks (8 tokens: chunks of 2 under cp4)
    "cp2-fsdp2-ep4": {"cp_size": 2, "fsdp_size": 2, "ep_size": 4},
    "cp4-all_to_all": {"cp_size": 4, "cp_mode": "all_to_all"},
    "cp2-tp2-sp": {"cp_size": 2, "tp_size": 2, "enable_sequence_parallel": True},
}
CASES = [(QWEN, layout) for layout in LAYOUTS] + [
    ("gptoss_e4_k3_gqa2_window5", "tp2-fsdp2"),
    ("gptoss_e4_k3_gqa2_window5", "pp2-tp2"),
    ("gptoss_e4_k3_gqa2_window5", "cp2-fsdp2-ep4"),
    ("deepseekv3_e8_k3_groups_qlora_yarn", "fsdp4-ep4"),
    ("deepseekv3_e8_k3_groups_qlora_yarn", "pp2-tp2"),
    ("deepseekv3_e8_k3_groups_qlora_yarn", "cp2-tp2-sp"),
]
ROWS, SEQ = 8, 7
CP_SEQ = 8  # a multiple of 2 * cp_size (and of tp_size on each cp rank's share)


def distinct_routes(shape, num_experts, seed):
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(*shape[:3], num_experts, generator=g)
    return scores.argsort(dim=-1)[..., : shape[3]].to(torch.int16)


@pytest.mark.parametrize(("name", "layout"), CASES, ids=[f"{n}-{layout}" for n, layout in CASES])
def test_rl_primitives_equal_one_process(name, layout, tiny_checkpoint, load_on_world, load_hf_model, plain_rl):
    ckpt = tiny_checkpoint(name)
    hf = load_hf_model(ckpt)
    config = dict(LAYOUTS[layout])
    if "pp_size" in config and name != QWEN:
        config["pp_size"] = 2
    seq = CP_SEQ if "cp_size" in config else SEQ
    with load_on_world(ckpt, config) as model:
        moe = model.model_config.moe
        vocab, slots, k = model.model_config.vocab_size, len(model.model_config.sparse_slots()), moe.num_experts_per_tok
        ids, mask, adv = plain_rl.rollout(vocab, rows=ROWS, seq=seq, seed=11)

        # log-probs and entropy, any B (5 rows over the data-parallel batches)
        got = model.logprobs(ids[:5], temperature=0.8, return_entropy=True, return_routed_experts=True)
        with torch.no_grad():
            torch.testing.assert_close(got.logprobs, plain_rl.logprobs(hf, ids[:5], 0.8), atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(got.entropy, plain_rl.entropy(hf, ids[:5], 0.8), atol=1e-5, rtol=1e-5)
        assert got.routed_experts.shape == (5, seq, slots, k)

        # replaying the recorded routes reproduces the forward exactly; other routes equal transformers forced
        assert torch.equal(model.logprobs(ids[:5], temperature=0.8, routed_experts=got.routed_experts), got.logprobs)
        routes = distinct_routes((ROWS, seq, slots, k), moe.num_experts, seed=12)
        forced = lambda: plain_rl.forced(routes, moe.num_experts, k)  # noqa: E731
        with torch.no_grad(), forced():
            expected = plain_rl.logprobs(hf, ids)
        torch.testing.assert_close(model.logprobs(ids, routed_experts=routes), expected, atol=1e-5, rtol=1e-5)

        # generate's routes are those of a full forward of the same rows
        prompts = ids[:3, :4].clamp_min(1)
        tokens, generated = model.generate(prompts, 3, return_routed_experts=True, eos_token_ids=())
        assert torch.equal(generated, model.logprobs(tokens, return_routed_experts=True).routed_experts)

        # a replayed PPO step (sequence-mean, DAPO clip, KL) with gradient accumulation and data parallelism
        model.configure_training(lr=1e-2, weight_decay=0.0, max_grad_norm=None, balance="none")
        old, ref = expected - 0.1, expected + 0.05
        options = {"clip_high": 0.28, "kl_coef": 0.1, "loss_aggregation": "sequence-mean"}
        metrics = model.train_step(
            ids,
            loss="ppo",
            advantages=adv,
            old_logprobs=old,
            ref_logprobs=ref,
            loss_mask=mask,
            routed_experts=routes,
            micro_batches=2,
            **options,
        )
        reference = copy.deepcopy(hf).train()
        optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.0)
        with forced():
            loss = plain_rl.loss(
                plain_rl.logprobs(reference, ids),
                old,
                adv,
                ref,
                mask,
                "ppo",
                "sequence-mean",
                clip_high=0.28,
                kl_coef=0.1,
            )
            loss.backward()
        norm = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters() if p.grad is not None])
        optimizer.step()
        assert metrics["loss"] == pytest.approx(loss.item(), rel=1e-5, abs=1e-7)
        assert metrics["grad_norm"] == pytest.approx(norm.item(), rel=1e-4)
        with torch.no_grad(), forced():
            after = plain_rl.logprobs(reference.eval(), ids)
        torch.testing.assert_close(model.logprobs(ids, routed_experts=routes), after, atol=5e-5, rtol=1e-4)


LOSS_CASES = [
    ("ppo", "token-mean", {}),
    ("ppo", "token-sum-norm", {"clip_c": 3.0, "max_new_tokens": 5}),
    ("importance_sampling", "sequence-mean", {"kl_coef": 0.05}),
]


def reinforce(logprobs, fields):
    """A callable loss (shipped to the ranks): REINFORCE, normalised by the loss tokens of the global batch."""
    mask = fields["loss_mask"]
    return -(logprobs * fields["advantages"] * mask).sum(), mask.sum()


@pytest.mark.parametrize("layout", ["dp_replicate2-fsdp2-ep2", "pp2-tp2"])
def test_every_loss_is_normalised_over_the_global_batch(
    layout, tiny_checkpoint, load_on_world, load_hf_model, plain_rl
):
    """Each loss and aggregation (and a callable) with data parallelism or a pipeline and 2 micro-batches: loss and
    gradient norm equal one process's (lr ~ 0, so every case sees the same weights)."""
    ckpt = tiny_checkpoint(QWEN)
    hf = load_hf_model(ckpt)
    with load_on_world(ckpt, LAYOUTS[layout]) as model:
        model.configure_training(lr=1e-12, weight_decay=0.0, max_grad_norm=None, balance="none")
        ids, mask, adv = plain_rl.rollout(model.model_config.vocab_size, rows=ROWS, seq=SEQ, seed=13)
        with torch.no_grad():
            base = plain_rl.logprobs(hf, ids)
        old, ref = base - 0.2 * adv.sign(), base + 0.1
        for kind, aggregation, options in [*LOSS_CASES, (reinforce, None, {})]:
            extra = {"loss_aggregation": aggregation} if aggregation else {}
            metrics = model.train_step(
                ids,
                loss=kind,
                advantages=adv,
                old_logprobs=old,
                ref_logprobs=ref,
                loss_mask=mask,
                micro_batches=2,
                **extra,
                **options,
            )
            reference = copy.deepcopy(hf).train()
            lp = plain_rl.logprobs(reference, ids)
            if callable(kind):
                loss = -(lp * adv * mask).sum() / mask.sum()
            else:
                loss = plain_rl.loss(lp, old, adv, ref, mask, kind, aggregation, **options)
            loss.backward()
            norm = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters() if p.grad is not None])
            assert metrics["loss"] == pytest.approx(loss.item(), rel=1e-5, abs=1e-7), kind
            assert metrics["grad_norm"] == pytest.approx(norm.item(), rel=1e-4), kind
