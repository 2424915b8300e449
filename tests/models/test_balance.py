"""Load-balancing math (SPEC LB-2) on plain tensors: the aux loss against transformers' load_balancing_loss_func,
capacity drops against a hand count, the bias step against its rule, and the router that uses them."""

from __future__ import annotations

import math

import pytest
import torch

from raymoe.models.common.config import MoeConfig
from raymoe.models.moe import GroupedExperts, SparseMoeBlock, TopKRouter
from raymoe.models.moe.balance import aux_loss_share, bias_step, capacity, over_capacity

E, K = 6, 2


def transformers_aux(logits_per_layer, mask=None):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    return float(load_balancing_loss_func(tuple(logits_per_layer), E, K, mask))


def shares(logits_per_layer, masks_per_rank, rows_per_rank, per_layer=False):
    """Each rank's share with the global statistics; ``rows_per_rank`` slices the flattened tokens."""
    counts = torch.zeros(len(logits_per_layer), E, dtype=torch.float64)
    tokens = torch.zeros((), dtype=torch.float64)
    probs_per_rank = []
    for rank_rows, mask in zip(rows_per_rank, masks_per_rank, strict=True):
        prob_sum = torch.zeros(len(logits_per_layer), E)
        for layer, logits in enumerate(logits_per_layer):
            probs = torch.softmax(logits[rank_rows], dim=-1)
            _, ids = torch.topk(probs, K, dim=-1)
            counts[layer] += torch.zeros(E).scatter_add_(0, ids.reshape(-1), mask.repeat_interleave(K)).double()
            prob_sum[layer] = (probs * mask[:, None]).sum(dim=0)
        tokens += mask.sum()
        probs_per_rank.append(prob_sum)
    return [aux_loss_share(p, counts.float(), tokens.float(), per_layer=per_layer) for p in probs_per_rank]


def test_shares_over_data_parallel_ranks_sum_to_the_global_aux_loss_and_a_per_rank_aux_does_not():
    gen = torch.Generator().manual_seed(0)
    tokens = 24
    # Two layers; the second rank's tokens favour other experts than the first's (as real shards do).
    logits = [torch.randn(tokens, E, generator=gen) for _ in range(2)]
    for layer in logits:
        layer[:12, :2] += 2.0
        layer[12:, 3:] += 1.5
    mask = torch.ones(tokens)
    mask[20:] = 0  # padding at the end of the second rank's rows
    rows = [slice(0, 12), slice(12, 24)]
    want = transformers_aux(logits, mask.reshape(2, 12))
    got = sum(shares(logits, [mask[r] for r in rows], rows))
    assert got == pytest.approx(want, rel=1e-6)
    # What transformers computes under data parallelism: each rank's aux loss of its own rows, averaged.
    per_rank = sum(transformers_aux([x[r] for x in logits], mask[r][None]) for r in rows) / 2
    assert abs(per_rank - want) > 1e-3 * want  # far beyond the 1e-5 bar the layouts are held to


def test_the_per_layer_scope_is_the_mean_of_each_layers_aux_loss_and_sees_what_pooling_hides():
    gen = torch.Generator().manual_seed(1)
    # Layer 0 overloads experts 0-1, layer 1 experts 3-4: pooled over layers the load looks even.
    logits = [torch.randn(16, E, generator=gen) for _ in range(2)]
    logits[0][:, :2] += 3.0
    logits[1][:, 3:5] += 3.0
    mask, rows = torch.ones(16), [slice(0, 16)]
    per_layer = float(sum(shares(logits, [mask], rows, per_layer=True)))
    want = sum(transformers_aux([layer]) for layer in logits) / 2
    assert per_layer == pytest.approx(want, rel=1e-6)
    pooled = float(sum(shares(logits, [mask], rows)))
    assert pooled == pytest.approx(transformers_aux(logits), rel=1e-6)
    assert per_layer > pooled + 0.5  # pooling averages the two layers' overloads away


def test_aux_loss_share_gradient_flows_into_the_probabilities_only():
    probs = torch.rand(1, E, requires_grad=True)
    counts = torch.arange(E, dtype=torch.float32)[None]
    share = aux_loss_share(probs, counts, torch.tensor(10.0))
    share.backward()
    torch.testing.assert_close(probs.grad, E * counts / 100)


def test_bias_step_moves_every_expert_towards_the_mean():
    load = torch.tensor([[10, 0, 5, 5], [3, 3, 3, 3]])
    torch.testing.assert_close(bias_step(load, 0.01), torch.tensor([[-0.01, 0.01, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]))


def test_capacity_is_the_ceiling_of_the_fair_share():
    assert capacity(sequence_length=10, top_k=2, num_experts=8, capacity_factor=1.0) == 3  # ceil(2.5)
    assert capacity(sequence_length=8, top_k=2, num_experts=8, capacity_factor=1.25) == 3  # ceil(2.5)


def test_over_capacity_drops_the_lowest_probabilities_of_each_sequence_and_expert():
    # two sequences of 4 tokens, top-2 of 4 experts: capacity ceil(1.0 * 4 * 2 / 4) = 2 pairs per expert
    ids = torch.tensor([[0, 1], [0, 2], [0, 1], [0, 3], [1, 2], [1, 0], [3, 2], [2, 1]])
    probs = torch.tensor(
        [[0.5, 0.3], [0.6, 0.2], [0.4, 0.3], [0.7, 0.1], [0.5, 0.4], [0.6, 0.3], [0.5, 0.4], [0.5, 0.4]]
    )
    dropped = over_capacity(ids, probs, sequence_length=4, num_experts=4, capacity_factor=1.0)
    # sequence 0: expert 0 has 4 pairs (0.5, 0.6, 0.4, 0.7): keeps 0.7 and 0.6, drops 0.5 and 0.4;
    # expert 1 has 2 (kept), 2 and 3 one each. Sequence 1: expert 1 has 3 pairs (0.5, 0.6, 0.4): drops 0.4;
    # expert 2 has 3 (0.4, 0.4, 0.5): drops the later 0.4 (equal probabilities: the earlier token stays).
    expected = torch.zeros(8, 2, dtype=torch.bool)
    expected[0, 0] = expected[2, 0] = expected[7, 1] = expected[6, 1] = True
    hand = {(0, 0): 2, (1, 1): 1, (1, 2): 1}  # (sequence, expert): pairs over the capacity of 2
    assert int(dropped.sum()) == sum(hand.values())
    assert torch.equal(dropped, expected)


def test_a_large_capacity_drops_nothing():
    ids = torch.randint(0, 4, (12, 2))
    assert not over_capacity(ids, torch.rand(12, 2), 6, 4, capacity_factor=4.0).any()


def moe_config(**overrides):
    return MoeConfig(num_experts=E, num_experts_per_tok=K, moe_intermediate_size=8, norm_topk_prob=True, **overrides)


def test_the_selection_bias_moves_the_choice_but_not_the_weights():
    torch.manual_seed(0)
    router = TopKRouter(16, E, K, norm_topk_prob=False, selection_bias=True)
    torch.nn.init.normal_(router.weight, std=0.5)
    hidden = torch.randn(9, 16)
    plain_ids, _, logits = router(hidden)
    with torch.no_grad():
        router.e_score_correction_bias[5] = 10.0  # expert 5 wins every token's choice
    ids, weights, _ = router(hidden)
    assert (ids == 5).any(dim=1).all() and not (plain_ids == 5).all()
    probs = torch.softmax(logits.float(), dim=-1)
    torch.testing.assert_close(weights, probs.gather(-1, ids))  # the weights are probabilities, unbiased
    assert "e_score_correction_bias" in dict(router.named_parameters())
    assert "e_score_correction_bias" not in dict(TopKRouter(16, E, K, False).named_parameters())


def test_capacity_drops_pairs_in_training_only_and_dropped_pairs_add_nothing():
    torch.manual_seed(0)
    block = SparseMoeBlock(16, moe_config())
    block.experts.reset_parameters(std=0.2)
    torch.nn.init.normal_(block.gate.weight, std=0.5)
    with torch.no_grad():
        block.gate.weight[0] += 3.0 * block.gate.weight[1]  # a skewed router
    x = torch.randn(3, 8, 16)
    block.gate.capacity_factor = 1.0
    block.gate.record = True
    block.train()
    out = block(x)
    record = block.gate.last_routing
    assert record is not None and record.dropped_TK is not None
    assert int(record.num_dropped) > 0
    # Reference: the same routing without the limit, with exactly the dropped pairs' weights zeroed.
    ids = record.chosen_TK
    chosen_probs = record.probs_TE.gather(-1, ids)
    weights = chosen_probs / chosen_probs.sum(dim=-1, keepdim=True)
    expected = block.experts(x.reshape(-1, 16), ids, weights.masked_fill(record.dropped_TK, 0.0)).view_as(x)
    torch.testing.assert_close(out, expected)
    block.eval()
    unlimited = block(x)
    assert not torch.allclose(unlimited, out)  # evaluation keeps every pair
    assert math.isfinite(float(unlimited.detach().sum()))


def test_grouped_experts_skip_negative_ids():
    experts = GroupedExperts(4, 8, 4)
    experts.reset_parameters(std=0.2)
    hidden = torch.randn(5, 8)
    ids = torch.tensor([[0, 1], [2, 3], [1, 0], [3, 2], [0, 3]])
    weights = torch.rand(5, 2)
    dropped = torch.zeros(5, 2, dtype=torch.bool)
    dropped[1, 0] = dropped[4, 1] = True
    got = experts(hidden, torch.where(dropped, ids - 4, ids), weights)
    want = experts(hidden, ids, weights.masked_fill(dropped, 0.0))
    torch.testing.assert_close(got, want)
