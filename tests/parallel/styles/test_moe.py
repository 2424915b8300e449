"""MoE tensor-parallel styles against their unsharded twins on two CPU ranks (gloo, fp32).

The experts twin has the contract of ``raymoe.models``' experts: fused ``gate_up_proj [E, 2I, H]``
and ``down_proj [E, H, I]``, forward ``(hidden [T, H], topk_ids [T, k], topk_weights [T, k]) -> [T, H]``.
A router in front makes the routing weights depend on parameters, so their gradient is checked too.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

H, INTER, E, TOP_K, TOKENS = 8, 6, 4, 2, 10  # INTER: I, each expert's intermediate size


class Experts(nn.Module):
    """Qwen3-MoE layout: ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]`` (``nn.Linear`` style ``[out, in]``)."""

    def __init__(self, identity_expert=False):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(E, 2 * INTER, H) / H**0.5)
        self.down_proj = nn.Parameter(torch.randn(E, H, INTER) / INTER**0.5)
        # an extra expert id E that passes its input through (LongCat's zero experts)
        self.identity = nn.Identity() if identity_expert else None

    def forward(self, hidden, topk_ids, topk_weights):
        out = torch.zeros_like(hidden)
        for expert in range(E):
            token, slot = torch.where(topk_ids == expert)
            gate, up = F.linear(hidden[token], self.gate_up_proj[expert]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[expert])
            out = out.index_add(0, token, y * topk_weights[token, slot, None])
        if self.identity is not None:
            token, slot = torch.where(topk_ids == E)
            out = out.index_add(0, token, self.identity(hidden[token]) * topk_weights[token, slot, None])
        return out


class BmmExperts(nn.Module):
    """Llama4 layout: ``gate_up_proj [E, H, 2I]`` as ``x @ W`` (packed on its last dim), ``down_proj [E, I, H]``."""

    def __init__(self):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(E, H, 2 * INTER) / H**0.5)
        self.down_proj = nn.Parameter(torch.randn(E, INTER, H) / INTER**0.5)

    def forward(self, hidden, topk_ids, topk_weights):
        out = torch.zeros_like(hidden)
        for expert in range(E):
            token, slot = torch.where(topk_ids == expert)
            gate, up = (hidden[token] @ self.gate_up_proj[expert]).chunk(2, dim=-1)
            y = (F.silu(gate) * up) @ self.down_proj[expert]
            out = out.index_add(0, token, y * topk_weights[token, slot, None])
        return out


class SparseMoe(nn.Module):
    """Router (``gate``, replicated) returning top-k ids and weights separately, then the experts."""

    def __init__(self, experts, num_choices=E):
        super().__init__()
        self.gate = nn.Linear(H, num_choices, bias=False)
        self.experts = experts

    def forward(self, hidden):
        weights, ids = torch.topk(self.gate(hidden).softmax(dim=-1), TOP_K, dim=-1)
        return self.experts(hidden, ids, weights / weights.sum(dim=-1, keepdim=True))


QWEN_RULES = {
    "experts.gate_up_proj": "packed_colwise",
    "experts.down_proj": "rowwise",
    "experts": "moe_tp_experts",
}


def compare_moe(rank, full, rules):
    sharded = rank.sharded_twin(full, rules)
    x = torch.randn(TOKENS, H, generator=torch.Generator().manual_seed(1))
    x_full, x_sharded = x.clone().requires_grad_(), x.clone().requires_grad_()
    want, got = full(x_full), sharded(x_sharded)
    rank.expect_close("output", got, want)
    with torch.no_grad():
        rank.expect_close("no_grad output", sharded(x), want)
    probe = torch.randn(want.shape, generator=torch.Generator().manual_seed(7))
    (want * probe).sum().backward()
    (got * probe).sum().backward()
    rank.expect_close_rel("hidden grad", x_sharded.grad, x_full.grad)
    rank.expect_same_grads(sharded, full)
    return sharded


def check_moe_tp_experts(rank):
    torch.manual_seed(0)
    sharded = compare_moe(rank, SparseMoe(Experts()), QWEN_RULES)
    # each rank holds its slice of every expert's intermediate dim
    assert sharded.experts.gate_up_proj.to_local().shape == (E, 2 * INTER // rank.world_size, H)
    assert sharded.experts.down_proj.to_local().shape == (E, H, INTER // rank.world_size)


def check_moe_tp_experts_without_backward_all_reduce_is_wrong(rank):
    """The router's gradient needs the experts' backward all-reduce of the routing weights: without it, it differs."""
    from raymoe.parallel.styles import StyleRegistry
    from raymoe.parallel.styles.base import ParallelStyle
    from raymoe.parallel.styles.layouts import all_reduce_forward
    from raymoe.parallel.styles.tensor import PackedColwiseParallel, RowwiseParallel

    class ForwardOnlyExperts(ParallelStyle):
        def should_use_local_tensors(self, module):
            return True

        def transform_output_post_forward(self, module, output, mesh):
            return all_reduce_forward(output, mesh)

    registry = StyleRegistry()
    registry.register("packed_colwise", PackedColwiseParallel())
    registry.register("rowwise", RowwiseParallel())
    registry.register("moe_tp_experts", ForwardOnlyExperts())
    torch.manual_seed(0)
    full = SparseMoe(Experts())
    sharded = copy.deepcopy(full)
    from raymoe.parallel.apply import apply_rules

    apply_rules(sharded, QWEN_RULES, rank.mesh, registry)
    x = torch.randn(TOKENS, H, generator=torch.Generator().manual_seed(1))
    rank.expect_close("output", sharded(x), full(x))
    full(x).square().sum().backward()
    sharded(x).square().sum().backward()
    diff = (sharded.gate.weight.grad - full.gate.weight.grad).abs().max().item()
    assert diff > 1e-4, f"without the backward all-reduce the router gradient should be partial, diff {diff}"


def check_packed_rowwise_experts(rank):
    torch.manual_seed(0)
    rules = {
        "experts.gate_up_proj": "packed_rowwise",
        "experts.down_proj": "colwise",
        "experts": "moe_tp_experts",
    }
    sharded = compare_moe(rank, SparseMoe(BmmExperts()), rules)
    assert sharded.experts.gate_up_proj.to_local().shape == (E, H, 2 * INTER // rank.world_size)


def check_moe_identity_expert(rank):
    """An identity expert inside TP experts: without the pre-division its output would be summed tp times."""
    torch.manual_seed(0)
    rules = {**QWEN_RULES, "experts.identity": "moe_identity_expert"}
    full = SparseMoe(Experts(identity_expert=True), num_choices=E + 1)
    with torch.no_grad():
        full.gate.weight[E] += 2.0  # route most tokens to the identity expert too
    compare_moe(rank, full, rules)
    without = rank.sharded_twin(full, QWEN_RULES)
    x = torch.randn(TOKENS, H, generator=torch.Generator().manual_seed(1))
    diff = (without(x) - full(x)).abs().max().item()
    assert diff > 1e-3, f"without moe_identity_expert the identity output should be summed twice, diff {diff}"


def check_moe_no_grad(rank):
    torch.manual_seed(0)
    full = SparseMoe(Experts())
    sharded = rank.sharded_twin(full, QWEN_RULES)
    x = torch.randn(TOKENS, H, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        rank.expect_close("no_grad output", sharded(x), full(x))


def test_moe_tp_experts(tp2):
    tp2.run(check_moe_tp_experts)


def test_moe_tp_experts_needs_its_backward_all_reduce(tp2):
    tp2.run(check_moe_tp_experts_without_backward_all_reduce_is_wrong)


def test_packed_rowwise_on_bmm_layout_experts(tp2):
    tp2.run(check_packed_rowwise_experts)


def test_moe_identity_expert(tp2):
    tp2.run(check_moe_identity_expert)


def test_moe_inference_without_grad(tp2):
    tp2.run(check_moe_no_grad)
