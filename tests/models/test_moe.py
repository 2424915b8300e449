"""Router, grouped experts and the grouped-GEMM seam, against plain per-token arithmetic."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from raymoe.models.common.config import MoeConfig
from raymoe.models.moe import GroupedExperts, SparseMoeBlock, TopKRouter, grouped_mm, select_gemm_backend

BACKENDS = ["padded", "grouped_mm"]


def _experts(num_experts=6, hidden=16, inter=8, seed=0) -> GroupedExperts:
    torch.manual_seed(seed)
    experts = GroupedExperts(num_experts, hidden, inter)
    experts.reset_parameters(std=0.2)
    return experts


def _per_token_reference(experts: GroupedExperts, hidden, ids, weights):
    """y[t] = sum_k weights[t, k] * expert_{ids[t, k]}(hidden[t]), one token at a time."""
    inter = experts.down_proj.shape[2]
    rows = []
    for t in range(hidden.shape[0]):
        total = torch.zeros_like(hidden[t])
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            gate, up = experts.gate_up_proj[e, :inter], experts.gate_up_proj[e, inter:]
            total = total + weights[t, k] * (experts.down_proj[e] @ (F.silu(gate @ hidden[t]) * (up @ hidden[t])))
        rows.append(total)
    return torch.stack(rows)


def _routing(tokens, top_k, num_experts, seed=1, skip_expert=None):
    generator = torch.Generator().manual_seed(seed)
    choices = [e for e in range(num_experts) if e != skip_expert]
    ids = torch.stack(
        [torch.tensor(choices)[torch.randperm(len(choices), generator=generator)[:top_k]] for _ in range(tokens)]
    )
    return ids, torch.rand(tokens, top_k, generator=generator)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("tokens", "top_k"), [(1, 1), (7, 3), (20, 2)])
def test_experts_forward_and_backward_match_per_token_reference(backend, tokens, top_k):
    experts = _experts()
    experts.gemm_backend = backend
    hidden = torch.randn(tokens, 16, requires_grad=True)
    ids, weights = _routing(tokens, top_k, 6, skip_expert=2)  # expert 2 receives nothing
    weights.requires_grad_(True)

    actual = experts(hidden, ids, weights)
    expected = _per_token_reference(experts, hidden, ids, weights)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)

    grad = torch.randn_like(actual)
    inputs = (hidden, weights, experts.gate_up_proj, experts.down_proj)
    for got, want in zip(
        torch.autograd.grad(actual, inputs, grad), torch.autograd.grad(expected, inputs, grad), strict=True
    ):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert torch.autograd.grad(experts(hidden, ids, weights).sum(), experts.gate_up_proj)[0][2].abs().sum() == 0


class _OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(("backend", "kernel"), [("grouped_mm", "_grouped_mm"), ("padded", "bmm")])
def test_no_loop_over_experts(backend, kernel):
    """Two GEMM kernels per forward whatever the expert count: no per-expert matmuls."""
    experts = _experts(num_experts=32)
    experts.gemm_backend = backend
    ids, weights = _routing(64, 4, 32)
    with _OpCounter() as counter, torch.no_grad():
        experts(torch.randn(64, 16), ids, weights)
    assert counter.ops[kernel] == 2
    assert counter.ops["mm"] == counter.ops["addmm"] == counter.ops["matmul"] == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_grouped_mm_seam_with_empty_groups(backend):
    counts = torch.tensor([3, 0, 5, 0, 1])
    x = torch.randn(int(counts.sum()), 8)
    w = torch.randn(5, 12, 8)
    expected = torch.cat(
        [
            x[s:e] @ w[i].T
            for i, (s, e) in enumerate(
                zip((counts.cumsum(0) - counts).tolist(), counts.cumsum(0).tolist(), strict=True)
            )
        ]
    )
    torch.testing.assert_close(grouped_mm(x, w, counts, backend), expected)
    assert grouped_mm(x[:0], w, torch.zeros(5, dtype=torch.int64), backend).shape == (0, 12)


def test_backend_selection_on_cpu():
    aligned = torch.randn(4, 8, 16)
    assert select_gemm_backend(torch.randn(3, 16), aligned) == "grouped_mm"
    assert select_gemm_backend(torch.randn(3, 16).bfloat16(), aligned.bfloat16()) == "grouped_mm"
    assert select_gemm_backend(torch.randn(3, 10), torch.randn(4, 8, 10)) == "padded"  # K not 16-byte aligned
    assert select_gemm_backend(torch.randn(3, 16), torch.randn(4, 6, 16)) == "padded"  # N not aligned (backward)
    assert select_gemm_backend(torch.randn(3, 16).half(), aligned.half()) == "padded"
    assert select_gemm_backend(torch.randn(3, 16), aligned.transpose(1, 2).contiguous().transpose(1, 2)) == "padded"
    with pytest.raises(ValueError, match="unknown grouped GEMM backend 'loop'"):
        grouped_mm(torch.randn(3, 16), aligned, torch.tensor([1, 1, 1, 0]), "loop")  # type: ignore[arg-type]


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_router_returns_ids_and_weights_separately(norm_topk_prob):
    torch.manual_seed(0)
    router = TopKRouter(hidden_size=16, num_experts=7, top_k=3, norm_topk_prob=norm_topk_prob)
    torch.nn.init.normal_(router.weight)
    hidden = torch.randn(5, 16)
    ids, weights, logits = router(hidden)
    assert ids.shape == weights.shape == (5, 3) and ids.dtype == torch.int64 and weights.dtype == hidden.dtype
    assert logits.shape == (5, 7)
    probs = torch.softmax(hidden @ router.weight.T, dim=-1)
    torch.testing.assert_close(
        weights, probs.gather(1, ids) / (probs.gather(1, ids).sum(-1, keepdim=True) if norm_topk_prob else 1)
    )
    assert (probs.gather(1, ids).min(dim=1).values >= probs.topk(3).values[:, -1] - 1e-7).all()


def test_block_composes_router_and_experts():
    torch.manual_seed(0)
    block = SparseMoeBlock(16, MoeConfig(num_experts=5, num_experts_per_tok=2, moe_intermediate_size=8))
    torch.nn.init.normal_(block.gate.weight)
    block.experts.reset_parameters(std=0.2)
    x = torch.randn(2, 3, 16)
    ids, weights, _ = block.gate(x.reshape(6, 16))
    torch.testing.assert_close(
        block(x), _per_token_reference(block.experts, x.reshape(6, 16), ids, weights).view(2, 3, 16)
    )


def test_row_moves_are_a_custom_op_with_index_selects_gradient():
    """``raymoe::gather_rows``: ``index_select`` forward, ``index_add_`` backward (repeated rows add up), and its
    fake and autograd registrations pass torch's own checks."""
    from raymoe.models.moe.rows import gather_rows

    x = torch.randn(5, 4, requires_grad=True)
    index = torch.tensor([3, 0, 3, 4, 1, 3])
    got = gather_rows(x, index)
    expected = x.index_select(0, index)
    assert torch.equal(got, expected)
    grad = torch.randn(6, 4)
    (got_grad,) = torch.autograd.grad(got, x, grad)
    (expected_grad,) = torch.autograd.grad(expected, x, grad)
    torch.testing.assert_close(got_grad, expected_grad)
    torch.library.opcheck(gather_rows, (x, index))


def test_compiled_experts_keep_the_row_moves_opaque_on_cpu():
    """Under ``torch.compile`` on CPU the sort's gather and the way back run as ``raymoe::gather_rows`` (inductor
    would fuse them into a loop vectorised along top-k): two per forward, the same outputs and gradients as eager."""
    from torch._dynamo.testing import AotEagerAndRecordGraphs

    experts = _experts()
    hidden = torch.randn(9, 16)
    ids, weights = _routing(9, 3, 6)
    eager_x, compiled_x = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()
    expected = experts(eager_x, ids, weights)
    expected.sum().backward()
    backend = AotEagerAndRecordGraphs()
    got = torch.compile(experts, backend=backend, fullgraph=True)(compiled_x, ids, weights)
    got.sum().backward()
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(compiled_x.grad, eager_x.grad)
    forward = str(backend.fw_graphs[0].code)
    assert forward.count("raymoe.gather_rows") == 2, forward  # the routing weights' 1-D gather stays index_select
    assert str(backend.bw_graphs[0].code).count("raymoe.scatter_add_rows") == 2


def test_compiled_padded_backend_is_one_op_with_its_sync_inside():
    """Under ``torch.compile`` the padded backend runs as ``raymoe::padded_grouped_mm``: its host sync for the buffer's
    size stays inside the op (no graph break, no graph specialised to one routing's largest count), its backward is the
    same op over the transposed weights and ``raymoe::padded_grouped_mm_weight_grad``, and the outputs and gradients
    are eager's (an expert without rows included)."""
    from torch._dynamo.testing import AotEagerAndRecordGraphs
    from torch._dynamo.utils import counters

    from raymoe.models.moe.grouped_mm import _padded_weight_grad, _traced_padded_mm

    counts = torch.tensor([3, 0, 5, 3])
    x = torch.randn(11, 10, requires_grad=True)
    w = torch.randn(4, 6, 10, requires_grad=True)
    grad = torch.randn(11, 6)
    expected = grouped_mm(x, w, counts, "padded")
    want = torch.autograd.grad(expected, (x, w), grad)
    torch._dynamo.reset()
    counters.clear()
    backend = AotEagerAndRecordGraphs()
    compiled = torch.compile(lambda *args: grouped_mm(*args, "padded"), backend=backend, fullgraph=True)
    got = compiled(x, w, counts)
    assert torch.equal(got, expected)
    for got_grad, want_grad in zip(torch.autograd.grad(got, (x, w), grad), want, strict=True):
        torch.testing.assert_close(got_grad, want_grad)
    compiled(x, w, torch.tensor([1, 7, 0, 3]))  # another routing, another largest count: the same graph
    assert counters["stats"]["unique_graphs"] == 1
    assert str(backend.fw_graphs[0].code).count("raymoe.padded_grouped_mm.default(") == 1
    backward = str(backend.bw_graphs[0].code)
    assert backward.count("raymoe.padded_grouped_mm.default(") == 1  # the input's gradient
    assert backward.count("raymoe.padded_grouped_mm_weight_grad.default(") == 1
    torch.library.opcheck(_traced_padded_mm, (x, w, counts))
    torch.library.opcheck(_padded_weight_grad, (grad, x.detach(), counts))
