"""Expert-parallel styles against one process: raymoe's SparseMoeBlock (TopKRouter + GroupedExperts), gloo, fp32.

The twin test: every distinct batch of a layout (one per tp group, TOPO-1) goes through the unsharded
block in one process, concatenated; a rank's loss is the sum over its batch of ``output * probe``, so
the reference loss is the total. Each rank then runs its batch through a sharded copy (styles applied
with ``apply_rules`` on the ep mesh, as the runtime does with ``ResolvedPlans.ep_rules``) and
compares: its output rows (max abs <= 1e-5), its input rows' gradient, the router's gradient summed
over fsdp and the expert weights' gradients gathered over ep and summed over efsdp (each
norm-relative <= 1e-5) -- the sums FSDP2 makes in training.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from raymoe.models.common.config import MoeConfig
from raymoe.models.moe import GroupedExperts, SparseMoeBlock
from raymoe.parallel.styles import STYLES
from raymoe.parallel.styles.expert import EpDispatchExpertsParallel, EpRouterParallel, mask_foreign_experts
from raymoe.spec.config import DistributedConfig

H = 16
EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")

DISPATCH_RULES = {
    "experts.gate_up_proj": "grouped_gemm",
    "experts.down_proj": "grouped_gemm",
    "experts": "ep_dispatch_experts",
}
MASKING_RULES = {
    "gate": "ep_router",
    "experts.gate_up_proj": "grouped_gemm",
    "experts.down_proj": "grouped_gemm",
    "experts": "moe_tp_experts",
}


# --- the twin comparison ------------------------------------------------------------------------


def make_block(experts, top_k, inter=8, starve_last_of=None):
    """A SparseMoeBlock with random weights; ``starve_last_of=P``: the router never picks the last of P expert blocks.

    Top-k weights are renormalised, except at top-1, where that makes every weight 1 and the router's
    gradient rounding noise.
    """
    torch.manual_seed(0)
    block = SparseMoeBlock(H, MoeConfig(experts, top_k, inter, norm_topk_prob=top_k > 1))
    nn.init.normal_(block.gate.weight, std=0.5)
    block.experts.reset_parameters(std=0.2)
    if starve_last_of is not None:
        with torch.no_grad():  # inputs have x[:, 0] >= 2 (see batches), so these logits sit ~40 below the rest
            block.gate.weight[:, 0] = 0.0
            block.gate.weight[experts - experts // starve_last_of :, 0] = -20.0
    return block


def batches(tokens, count):
    """``count`` batches ``[T_b, H]``, ``T_b = tokens[b % len(tokens)]``, with a probe each (the loss weights)."""
    generator = torch.Generator().manual_seed(1)
    xs = [torch.randn(tokens[b % len(tokens)], H, generator=generator) for b in range(count)]
    for x in xs:
        x[:, 0] = x[:, 0].abs() + 2.0
    probes = [torch.randn(x.shape, generator=generator) for x in xs]
    return xs, probes


def registry_for(ctx, dispatch_style=None, router_style=None):
    """The built-in styles, with ep_dispatch_experts bound to this rank's tp group as the runtime binds it."""
    from raymoe.parallel.styles import StyleRegistry

    registry = StyleRegistry()
    for name in STYLES:
        registry.register(name, STYLES.get(name))
    dispatch_style = dispatch_style or EpDispatchExpertsParallel(tp_mesh=ctx.mesh("tp"))
    registry.register("ep_dispatch_experts", dispatch_style, replace=True)
    registry.register("ep_router", router_style or EpRouterParallel(), replace=True)
    return registry


def twin_pairs(rank, layout, case, dispatch_style=None, router_style=None):
    """``{what: (got, want)}`` for one layout and case; see the module docstring."""
    from raymoe.parallel.apply import apply_rules

    ctx = rank.context(**layout)
    ep_size = ctx.topology.axis_size("ep")
    full = make_block(case["experts"], case["top_k"], case.get("inter", 8), ep_size if case.get("starve") else None)
    sharded = copy.deepcopy(full)
    rules = MASKING_RULES if case.get("masking") else DISPATCH_RULES
    apply_rules(sharded, rules, ctx.mesh("ep"), registry_for(ctx, dispatch_style, router_style))

    xs, probes = batches(case["tokens"], len(ctx.topology.batch_ranks()))
    x_full = torch.cat(xs).requires_grad_()
    want = full(x_full.unsqueeze(0)).squeeze(0)
    (want * torch.cat(probes)).sum().backward()

    mine = ctx.coords.batch
    rows = slice(sum(len(x) for x in xs[:mine]), sum(len(x) for x in xs[: mine + 1]))
    x = xs[mine].clone().requires_grad_()
    got = sharded(x.unsqueeze(0)).squeeze(0)
    with torch.no_grad():
        got_no_grad = sharded(x.unsqueeze(0)).squeeze(0)
    (got * probes[mine]).sum().backward()

    pairs = {
        "output": (got, want[rows]),
        "no_grad output": (got_no_grad, want[rows]),
        "hidden grad": (x.grad, x_full.grad[rows]),
        "router grad": (summed(sharded.gate.weight.grad, ctx.mesh("fsdp")), full.gate.weight.grad),
    }
    for name in EXPERT_WEIGHTS:
        grad = getattr(sharded.experts, name).grad
        pairs[f"{name} grad"] = (summed(grad.full_tensor(), ctx.mesh("efsdp")), getattr(full.experts, name).grad)
    return pairs, sharded, full, ctx


def summed(tensor, mesh):
    """``tensor`` summed over ``mesh`` (a data-parallel axis: the gradient reduction FSDP2 does in training)."""
    total = tensor.detach().clone()
    dist.all_reduce(total, group=mesh.get_group())
    return total


def expect_twins(rank, pairs):
    for what, (got, want) in pairs.items():
        if "output" in what:
            rank.expect_close(what, got, want)
        else:
            rank.expect_close_norm(what, got, want)


def norm_diff(pair):
    got, want = pair
    return ((got - want).norm() / want.norm()).item()


# --- checks run on every rank -------------------------------------------------------------------


def check_twin(rank, layout, case):
    pairs, sharded, full, ctx = twin_pairs(rank, layout, case)
    expect_twins(rank, pairs)
    num_local = case["experts"] // ctx.topology.axis_size("ep")
    local = sharded.experts.gate_up_proj.to_local()
    assert local.shape[0] == num_local
    first = ctx.topology.experts_of(ctx.rank, case["experts"]).start
    assert torch.equal(local, full.experts.gate_up_proj[first : first + num_local].detach())  # TOPO-2
    if case.get("starve"):
        check_starved_rank(rank, sharded, full, ctx, case)


def check_starved_rank(rank, sharded, full, ctx, case):
    """The router never picks the last ep rank's experts: that rank joined every collective (no hang) and
    holds zero gradients, not missing ones (EP-5)."""
    ep_size = ctx.topology.axis_size("ep")
    last_block = case["experts"] - case["experts"] // ep_size
    xs, _ = batches(case["tokens"], len(ctx.topology.batch_ranks()))
    ids, _, _ = full.gate(torch.cat(xs))
    assert int(ids.max()) < last_block, "the crafted router must starve the last rank, or this checks nothing"
    if ctx.coords.ep == ep_size - 1:
        for name in EXPERT_WEIGHTS:
            grad = getattr(sharded.experts, name).grad
            assert grad is not None, f"{name}: no gradient on a rank that received no tokens"
            assert torch.count_nonzero(grad.to_local()) == 0


def check_dispatch_without_tp_gradient_sum_is_wrong(rank):
    """Negative control: with tp = 2, dispatch must all-reduce the input gradients over tp; without it the
    router's and the hidden states' gradients cover only this rank's slice of the rows."""

    class NoTpGradientSum(EpDispatchExpertsParallel):
        def replicate_over_tp(self, x, tp_mesh):
            return x

    layout = {"tp_size": 2, "ep_size": 2}
    case = {"experts": 4, "top_k": 2, "tokens": (6,)}
    ctx = rank.context(**layout)
    pairs, *_ = twin_pairs(rank, layout, case, dispatch_style=NoTpGradientSum(tp_mesh=ctx.mesh("tp")))
    rank.expect_close("output", *pairs["output"])
    rank.expect_close_norm("gate_up_proj grad", *pairs["gate_up_proj grad"])  # the experts' own are unaffected
    assert norm_diff(pairs["router grad"]) > 0.05, norm_diff(pairs["router grad"])
    assert norm_diff(pairs["hidden grad"]) > 0.05, norm_diff(pairs["hidden grad"])
    return norm_diff(pairs["router grad"]), norm_diff(pairs["hidden grad"])


def check_masking_with_zero_weights_only_is_wrong(rank):
    """Negative control: masking by weight 0 alone (foreign pairs on local expert ``g mod L``) gets the forward
    right but not the router gradient: the backward all-reduce of the routing weights' gradient adds each
    non-owner's output for the pair, and the mask's own backward drops the owner's gradient elsewhere."""

    class ZeroWeightRouter(EpRouterParallel):
        def transform_output_post_forward(self, module, output, mesh):
            ids, weights, logits = output
            local = logits.shape[-1] // mesh.size()
            own = ids // local == mesh.get_local_rank()
            return ids % local, weights.masked_fill(~own, 0.0), logits

    layout = {"tp_size": 2, "ep_size": 2}
    case = {"experts": 4, "top_k": 2, "tokens": (6,), "masking": True}
    pairs, *_ = twin_pairs(rank, layout, case, router_style=ZeroWeightRouter())
    rank.expect_close("output", *pairs["output"])
    assert norm_diff(pairs["router grad"]) > 0.05, norm_diff(pairs["router grad"])
    return norm_diff(pairs["router grad"])


def check_grouped_gemm_through_the_loader_bridge(rank, layout, num_experts):
    """A meta placeholder from grouped_gemm on the expert mesh's ep axis: the loader reads exactly this rank's
    experts (Topology.experts_of) and nothing else, and the loaded DTensor is the global tensor."""
    from raymoe.parallel.sharding import read_local_shard, shard_layout, with_local_shard

    ctx = rank.context(**layout)
    full = torch.randn(num_experts, 6, 4, generator=torch.Generator().manual_seed(3))
    with torch.device("meta"):
        experts = GroupedExperts(num_experts, 4, 3)
    placeholder = STYLES.get("grouped_gemm").shard_param(experts, "gate_up_proj", experts.gate_up_proj, ctx.mesh("ep"))
    mine = ctx.topology.experts_of(ctx.rank, num_experts)
    assert shard_layout(placeholder).ranges == ((mine,), (range(6),), (range(4),))
    assert experts.num_experts == len(mine)  # rewritten to the local count
    reads = []
    local = read_local_shard(placeholder, lambda block: reads.append(block) or full[block])
    assert reads == [(slice(mine.start, mine.stop), slice(0, 6), slice(0, 4))]
    assert torch.equal(with_local_shard(placeholder, local).full_tensor(), full)


# --- twin tests -----------------------------------------------------------------------------------

# (layout, case): tokens cycle over the batches; odd top-k, 6 experts, T = 1 under tp 2 (an empty slice);
# inter 6 takes GroupedExperts' padded GEMM, which skips an expert's weights when it gets no rows at all.
DISPATCH_W2 = {
    "tp1_ep2_uneven": ({"fsdp_size": 2, "ep_size": 2}, {"experts": 4, "top_k": 2, "tokens": (5, 3)}),
    "tp2_ep2_one_token": ({"tp_size": 2, "ep_size": 2}, {"experts": 4, "top_k": 3, "tokens": (1,)}),
    "tp2_ep2_uneven_slices": ({"tp_size": 2, "ep_size": 2}, {"experts": 6, "top_k": 1, "tokens": (7,), "inter": 6}),
    "tp1_ep2_starved_padded_gemm": (
        {"fsdp_size": 2, "ep_size": 2},
        {"experts": 4, "top_k": 2, "tokens": (5, 4), "starve": True, "inter": 6},
    ),
}
DISPATCH_W4 = {
    "tp1_ep4_top3": ({"fsdp_size": 4, "ep_size": 4}, {"experts": 8, "top_k": 3, "tokens": (5, 2, 4, 3)}),
    "tp2_ep2_e6": ({"tp_size": 2, "fsdp_size": 2, "ep_size": 2}, {"experts": 6, "top_k": 3, "tokens": (7, 4)}),
    "tp2_ep4": ({"tp_size": 2, "fsdp_size": 2, "ep_size": 4}, {"experts": 8, "top_k": 2, "tokens": (6, 3)}),
    "tp2_ep4_one_token": ({"tp_size": 2, "fsdp_size": 2, "ep_size": 4}, {"experts": 8, "top_k": 2, "tokens": (1, 3)}),
    "tp1_ep2_efsdp2_e6_top1": (
        {"fsdp_size": 4, "ep_size": 2},
        {"experts": 6, "top_k": 1, "tokens": (4, 6, 1, 3), "inter": 6},
    ),
    "tp1_ep4_starved": ({"fsdp_size": 4, "ep_size": 4}, {"experts": 8, "top_k": 2, "tokens": (4, 5), "starve": True}),
}
MASKING = {
    "w2_tp2_ep2": ({"tp_size": 2, "ep_size": 2}, {"experts": 4, "top_k": 2, "tokens": (7,), "masking": True}),
    "w4_tp2_ep2_e6_top3": (
        {"tp_size": 2, "fsdp_size": 2, "ep_size": 2},
        {"experts": 6, "top_k": 3, "tokens": (5, 3), "masking": True},
    ),
}


@pytest.mark.parametrize("name", list(DISPATCH_W2))
def test_dispatch_matches_one_process_on_two_ranks(tp2, name):
    tp2.run(check_twin, *DISPATCH_W2[name])


@pytest.mark.parametrize("name", list(DISPATCH_W4))
def test_dispatch_matches_one_process_on_four_ranks(world4, name):
    world4.run(check_twin, *DISPATCH_W4[name])


def test_masking_matches_one_process_on_two_ranks(tp2):
    tp2.run(check_twin, *MASKING["w2_tp2_ep2"])


def test_masking_matches_one_process_on_four_ranks(world4):
    world4.run(check_twin, *MASKING["w4_tp2_ep2_e6_top3"])


def test_dispatch_needs_the_tp_gradient_sum(tp2):
    tp2.run(check_dispatch_without_tp_gradient_sum_is_wrong)


def test_masking_needs_masked_ids_not_only_zero_weights(tp2):
    tp2.run(check_masking_with_zero_weights_only_is_wrong)


@pytest.mark.parametrize(
    ("layout", "num_experts"),
    [({"tp_size": 2, "fsdp_size": 2, "ep_size": 4}, 8), ({"fsdp_size": 4, "ep_size": 2}, 6)],
    ids=["ep4", "ep2_efsdp2"],
)
def test_grouped_gemm_through_the_loader_bridge(world4, layout, num_experts):
    world4.run(check_grouped_gemm_through_the_loader_bridge, layout, num_experts)


# --- driver side: validation, plans, the pieces -----------------------------------------------------


def meta_experts(num_experts):
    with torch.device("meta"):
        return SparseMoeBlock(H, MoeConfig(num_experts, 2, 8))


@pytest.mark.parametrize("style", ["grouped_gemm", "ep_dispatch_experts"])
def test_expert_weights_must_split_into_whole_experts(style):
    experts = meta_experts(6).experts
    STYLES.get(style).validate_param(experts, "gate_up_proj", experts.gate_up_proj, 3)
    with pytest.raises(ValueError, match=r"gate_up_proj \(6, 16, 16\): its 6 experts \(dim 0\) do not split into 4"):
        STYLES.get(style).validate_param(experts, "gate_up_proj", experts.gate_up_proj, 4)


def test_ep_router_needs_num_experts_divisible():
    gate = meta_experts(6).gate
    STYLES.get("ep_router").validate_param(gate, "weight", gate.weight, 2)
    with pytest.raises(ValueError, match=r"weight \(6, 16\): the router's 6 experts do not split into 4 equal blocks"):
        STYLES.get("ep_router").validate_param(gate, "weight", gate.weight, 4)


def test_local_expert_count_is_rewritten_once_and_checked():
    from raymoe.parallel.styles.expert import _set_local_expert_count

    experts = GroupedExperts(4, 8, 4)
    _set_local_expert_count(experts, 4, 2)
    _set_local_expert_count(experts, 4, 2)  # the module's second expert weight
    assert experts.num_experts == 2
    experts.num_experts = 3
    with pytest.raises(ValueError, match="num_experts=3 matches neither its expert weight's 4 experts"):
        _set_local_expert_count(experts, 4, 2)


def test_dispatch_needs_a_compute_seam():
    with pytest.raises(ValueError, match="Linear has no compute"):
        EpDispatchExpertsParallel().install_forward(nn.Linear(2, 2), mesh=None)


def test_mask_foreign_experts_maps_own_ids_to_local_and_spreads_the_others():
    ids = torch.tensor([[0, 5], [3, 4], [7, 2]])  # 8 experts, ep 4: rank 2 owns experts 4 and 5
    assert mask_foreign_experts(ids, 8, 2, 4).tolist() == [[-8, 1], [-5, 0], [-1, -6]]
    # masked ids run on local expert g mod L: 0, 1, 1, 0 -- spread, not all on expert 0
    assert (mask_foreign_experts(ids, 8, 2, 4) % 2).tolist() == [[0, 1], [1, 0], [1, 0]]
    with pytest.raises(ValueError, match="6 experts do not split into 4"):
        mask_foreign_experts(ids, 6, 0, 4)


def test_grouped_experts_run_masked_pairs_but_add_nothing():
    """GroupedExperts' side of masking: a negative id runs on expert id mod E with weight 0 and no weight gradient."""
    torch.manual_seed(0)
    experts = GroupedExperts(2, 8, 4)
    experts.reset_parameters(std=0.3)
    hidden = torch.randn(3, 8, requires_grad=True)
    weights = torch.rand(3, 2, requires_grad=True)
    masked = torch.tensor([[0, -3], [-2, 1], [1, -1]])
    kept_only = torch.tensor([[0, 0], [0, 1], [1, 1]])  # the same kept pairs, masked ones as weight-0 duplicates
    out = experts(hidden, masked, weights)
    want = experts(hidden, kept_only, weights * torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]]))
    torch.testing.assert_close(out, want)
    out.sum().backward()
    assert weights.grad[0, 1] == weights.grad[1, 0] == weights.grad[2, 1] == 0
    assert weights.grad[0, 0] != 0 and weights.grad[1, 1] != 0


TINY_QWEN3_MOE = {
    "model_type": "qwen3_moe",
    "vocab_size": 64,
    "hidden_size": 16,
    "intermediate_size": 24,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 8,
    "mlp_only_layers": [1],
    "max_position_embeddings": 64,
}


def resolve_qwen3_moe(**config):
    from raymoe.models import build_model, parse_model_config
    from raymoe.spec.plans import resolve_plans

    model_config = parse_model_config(TINY_QWEN3_MOE)
    model = build_model(model_config)  # on meta, as the driver does
    return resolve_plans(model, model.default_plans(), DistributedConfig(**config), num_experts=8)


def test_qwen3_moe_default_plan_resolves_to_dispatch():
    plans = resolve_qwen3_moe(tp_size=2, fsdp_size=2, ep_size=4)
    assert plans.expert_mode == "dispatch"
    assert plans.ep_rules == {
        "model.layers.0.mlp.experts": "ep_dispatch_experts",
        "model.layers.0.mlp.experts.gate_up_proj": "grouped_gemm",
        "model.layers.0.mlp.experts.down_proj": "grouped_gemm",
    }
    assert not any(path.startswith("model.layers.0.mlp.experts") for path in plans.tp_rules)  # EP wins (PLAN-5)


def test_qwen3_moe_masking_override_resolves():
    plans = resolve_qwen3_moe(
        tp_size=2,
        ep_size=2,
        ep_plan={"model.layers.*.mlp.gate": "ep_router", "model.layers.*.mlp.experts": "moe_tp_experts"},
    )
    assert plans.expert_mode == "masking"
    assert plans.ep_rules["model.layers.0.mlp.gate"] == "ep_router"
    assert plans.ep_rules["model.layers.0.mlp.experts"] == "moe_tp_experts"
    assert plans.ep_rules["model.layers.0.mlp.experts.gate_up_proj"] == "grouped_gemm"


def test_registered_styles_repr():
    assert repr(STYLES.get("ep_dispatch_experts")) == "EpDispatchExpertsParallel(tp_mesh=None)"
    assert repr(STYLES.get("grouped_gemm")) == "GroupedGemmParallel()"


# --- host syncs -----------------------------------------------------------------------------------

# Ops that read device values to the host (item()/int(), data-dependent output shapes).
HOST_SYNC_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2", "bincount"}


def check_dispatch_reads_no_device_value_but_the_split_sizes(rank):
    """The split sizes' ``.tolist()`` is the layer's one host sync (it bypasses the dispatcher on CPU);
    no other op of the forward or backward may read a device value to the host."""
    from raymoe.parallel.apply import apply_rules

    ctx = rank.context(fsdp_size=2, ep_size=2)
    block = make_block(4, 2)  # inter 8: GroupedExperts' grouped_mm path (its padded path has a sync of its own)
    apply_rules(block, DISPATCH_RULES, ctx.mesh("ep"), registry_for(ctx))
    x = batches((5, 3), 2)[0][ctx.coords.batch].requires_grad_()
    hidden, ids, weights = x, *block.gate(x)[:2]
    with rank.dispatched_ops() as ops:
        block.experts(hidden, ids, weights).sum().backward()
    names = {op.overloadpacket.__name__ for op in ops}
    assert "_grouped_mm" in names and "all_to_all_single" in names, sorted(names)  # it saw the layer
    assert not names & HOST_SYNC_OPS, sorted(names & HOST_SYNC_OPS)


def test_dispatch_reads_no_device_value_but_the_split_sizes(tp2):
    tp2.run(check_dispatch_reads_no_device_value_but_the_split_sizes)
