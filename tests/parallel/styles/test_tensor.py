"""Dense tensor-parallel styles against their unsharded twins on two CPU ranks (gloo, fp32).

Each check builds a small module with the shapes of the real one, copies it, applies the rules
to the copy on every rank, runs both on the same inputs and compares: forward outputs (max abs
diff <= 1e-5) and, after one backward, every parameter's gathered gradient and the inputs'
gradients (relative diff <= 1e-5). Styles whose point is a gradient all-reduce also run without
it and must then differ, so the comparison is shown to see what the style changes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from raymoe.parallel.styles import STYLES, ParallelStyle

H, INTER, HEADS, HEAD_DIM, VOCAB, SEQ, BATCH = 8, 12, 4, 4, 16, 6, 2


# --- twins (the shapes and call signatures of the real modules) -------------------------------


class Mlp(nn.Module):
    """up (colwise) -> silu -> down (rowwise), both with a bias."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(H, INTER)
        self.down = nn.Linear(INTER, H)

    def forward(self, x):
        return self.down(F.silu(self.up(x)))


class PackedMlp(nn.Module):
    """A fused gate_up Linear [2I, H] (packed_colwise) whose output is chunked, then down (rowwise)."""

    def __init__(self, pieces=2):
        super().__init__()
        self.pieces = pieces
        self.gate_up = nn.Linear(H, pieces * INTER)
        self.down = nn.Linear(INTER, H)

    def forward(self, x):
        first, *rest = self.gate_up(x).chunk(self.pieces, dim=-1)
        return self.down(F.silu(first) * sum(rest))


class HeadNormAttention(nn.Module):
    """q_proj (colwise) -> per-head q_norm over head_dim -> o_proj (rowwise): Qwen3's q_norm placement."""

    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(H, HEADS * HEAD_DIM, bias=False)
        self.q_norm = nn.RMSNorm(HEAD_DIM)
        self.o_proj = nn.Linear(HEADS * HEAD_DIM, H, bias=False)
        self.q_proj.tp_block_size = self.o_proj.tp_block_size = HEAD_DIM
        with torch.no_grad():
            self.q_norm.weight.uniform_(0.5, 1.5)

    def forward(self, x):
        q = self.q_proj(x)
        q = self.q_norm(q.view(*q.shape[:-1], -1, HEAD_DIM))  # -1: this rank's heads
        return self.o_proj(q.flatten(-2))


class SinkOwner(nn.Module):
    """A bare per-head parameter (attention sinks) used by its owner's forward."""

    def __init__(self):
        super().__init__()
        self.sinks = nn.Parameter(torch.linspace(0.5, 2.0, HEADS))

    def forward(self, q):
        return q * self.sinks.view(1, 1, -1, 1)


class SinkAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(H, HEADS * HEAD_DIM, bias=False)
        self.sink = SinkOwner()
        self.o_proj = nn.Linear(HEADS * HEAD_DIM, H, bias=False)

    def forward(self, x):
        q = self.q_proj(x)
        return self.o_proj(self.sink(q.view(*q.shape[:-1], -1, HEAD_DIM)).flatten(-2))


class Project(nn.Module):
    """A bare weight used by hand: with its weight split on the input features, each rank's output is partial."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(H, INTER) / INTER**0.5)

    def forward(self, x):
        return x @ self.weight.T


class PartialBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(H, INTER)
        self.project = Project()

    def forward(self, x):
        return self.project(torch.tanh(self.up(x)))


class MlaAttention(nn.Module):
    """DeepSeek-V2 style MLA keys: kv_a_proj -> [k_pass | k_rot]; k_pass -> norm -> kv_b_proj (colwise);
    k_rot bypasses kv_b_proj and is shared by this rank's heads."""

    ROPE, LORA = 2, 6

    def __init__(self):
        super().__init__()
        self.kv_a_proj_with_mqa = nn.Linear(H, self.LORA + self.ROPE, bias=False)
        self.kv_a_proj_with_mqa.qk_rope_head_dim = self.ROPE
        self.kv_a_layernorm = nn.RMSNorm(self.LORA)
        self.kv_b_proj = nn.Linear(self.LORA, HEADS * HEAD_DIM, bias=False)
        self.q_proj = nn.Linear(H, HEADS * (HEAD_DIM + self.ROPE), bias=False)
        self.o_proj = nn.Linear(HEADS * (HEAD_DIM + self.ROPE), H, bias=False)

    def forward(self, x):
        k_pass, k_rot = self.kv_a_proj_with_mqa(x).split([self.LORA, self.ROPE], dim=-1)
        k_pass = self.kv_b_proj(self.kv_a_layernorm(k_pass))
        k_pass = k_pass.view(*k_pass.shape[:-1], -1, HEAD_DIM)
        k = torch.cat([k_pass, k_rot.unsqueeze(-2).expand(*k_pass.shape[:-1], self.ROPE)], dim=-1)
        q = self.q_proj(x)
        q = q.view(*q.shape[:-1], -1, HEAD_DIM + self.ROPE)
        return self.o_proj((q * k).flatten(-2))


class Embed(nn.Module):
    """Token embedding (with a padding row, as HF models build it) followed by a head-free projection."""

    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, H, padding_idx=VOCAB - 3)

    def forward(self, ids):
        return self.embed_tokens(ids)


# --- the twin comparison ------------------------------------------------------------------------


def compare_twins(rank, full, rules, inputs, *, split_inputs=None, split_output=None, expect_grads=True, registry=None):
    """Run ``full`` and its sharded copy on ``inputs``; compare outputs (with and without autograd), then
    (``expect_grads``) the gradients.

    ``split_inputs`` {index: dim}: the sharded copy gets this rank's chunk of that input (an input
    that arrives sharded); ``split_output`` dim: the sharded output is this rank's chunk. The loss is
    ``sum(output * probe)``; with a split output each rank sums its chunk, so the ranks' losses add up
    to the unsharded one.
    """
    split_inputs = split_inputs or {}
    sharded = rank.sharded_twin(full, rules) if registry is None else _twin_with(rank, full, rules, registry)
    full_in = [t.clone().requires_grad_(t.is_floating_point()) for t in inputs]
    sharded_in = [
        (rank.local_part(t, split_inputs[i]) if i in split_inputs else t).clone().requires_grad_(t.is_floating_point())
        for i, t in enumerate(inputs)
    ]
    want, got = full(*full_in), sharded(*sharded_in)
    probe = torch.randn(want.shape, generator=torch.Generator().manual_seed(7))
    if split_output is not None:
        want_local, probe_local = rank.local_part(want, split_output), rank.local_part(probe, split_output)
    else:
        want_local, probe_local = want, probe
    rank.expect_close("output", got, want_local)
    with torch.no_grad():  # inference: the layout changes take the plain-collective path
        rank.expect_close("no_grad output", sharded(*sharded_in), want_local)
    (want * probe).sum().backward()
    (got * probe_local).sum().backward()
    if not expect_grads:
        return sharded
    for i, (a, b) in enumerate(zip(sharded_in, full_in, strict=True)):
        if b.grad is not None:
            grad_b = rank.local_part(b.grad, split_inputs[i]) if i in split_inputs else b.grad
            rank.expect_close_rel(f"input {i} grad", a.grad, grad_b)
    rank.expect_same_grads(sharded, full)
    return sharded


def _twin_with(rank, full, rules, registry):
    import copy

    from raymoe.parallel.apply import apply_rules

    twin = copy.deepcopy(full)
    apply_rules(twin, rules, rank.mesh, registry)
    return twin


def hidden(*shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(1))


# --- checks run on every rank -------------------------------------------------------------------


def check_colwise_rowwise(rank, colwise, rowwise):
    """colwise -> rowwise pair, the attention / MLP pattern."""
    torch.manual_seed(0)
    compare_twins(rank, Mlp(), {"up": colwise, "down": rowwise}, [hidden(BATCH, SEQ, H)])


def check_gathered_colwise(rank, style):
    torch.manual_seed(0)
    compare_twins(rank, nn.Sequential(nn.Linear(H, INTER)), {"0": style}, [hidden(BATCH, SEQ, H)])


def check_local_colwise(rank):
    """colwise alone: its output stays this rank's slice of the output features."""
    torch.manual_seed(0)
    compare_twins(rank, nn.Sequential(nn.Linear(H, INTER)), {"0": "colwise"}, [hidden(SEQ, H)], split_output=-1)


def check_rowwise_sharded_input(rank):
    """rowwise alone takes its input already split on the last dim (what colwise leaves)."""
    torch.manual_seed(0)
    compare_twins(
        rank, nn.Sequential(nn.Linear(INTER, H)), {"0": "rowwise"}, [hidden(SEQ, INTER)], split_inputs={0: -1}
    )


def check_rowwise_replicated_input(rank, style):
    torch.manual_seed(0)
    compare_twins(rank, nn.Sequential(nn.Linear(INTER, H)), {"0": style}, [hidden(BATCH, SEQ, INTER)])


def check_rowwise_reduce_scatter(rank):
    """RowwiseParallel(output_layout=Shard(1)): the partial sums are reduce-scattered over the sequence."""
    from torch.distributed.tensor import Shard

    from raymoe.parallel.styles import StyleRegistry
    from raymoe.parallel.styles.tensor import RowwiseParallel

    registry = StyleRegistry()
    registry.register("rowwise_to_sequence", RowwiseParallel(output_layout=Shard(1)))
    torch.manual_seed(0)
    compare_twins(
        rank,
        nn.Sequential(nn.Linear(INTER, H)),
        {"0": "rowwise_to_sequence"},
        [hidden(BATCH, SEQ, INTER)],
        split_inputs={0: -1},
        split_output=1,
        registry=registry,
    )


def check_packed_colwise(rank):
    """gate_up packed [gate; up]: chunk(2) of each rank's output must pair gate and up of the same features."""
    torch.manual_seed(0)
    compare_twins(rank, PackedMlp(), {"gate_up": "packed_colwise", "down": "rowwise"}, [hidden(SEQ, H)])


def check_packed_colwise_split_factor_3(rank):
    """split_factor for other packings (three pieces, like a fused qkv)."""
    from raymoe.parallel.styles import StyleRegistry
    from raymoe.parallel.styles.tensor import PackedColwiseParallel, RowwiseParallel

    registry = StyleRegistry()
    registry.register("packed3", PackedColwiseParallel(split_factor=3))
    registry.register("rowwise", RowwiseParallel())
    torch.manual_seed(0)
    compare_twins(rank, PackedMlp(3), {"gate_up": "packed3", "down": "rowwise"}, [hidden(SEQ, H)], registry=registry)


def check_packed_colwise_plain_shard_misaligns(rank):
    """The same fused weight under plain colwise pairs the wrong halves: the output must differ."""
    torch.manual_seed(0)
    full = PackedMlp()
    sharded = rank.sharded_twin(full, {"gate_up": "colwise", "down": "rowwise"})
    x = hidden(SEQ, H)
    diff = (sharded(x) - full(x)).abs().max().item()
    assert diff > 1e-3, f"plain colwise on a packed weight should misalign gate and up, diff {diff}"


def check_embedding(rank, style):
    torch.manual_seed(0)
    ids = torch.tensor([[0, 5, VOCAB - 1, VOCAB - 3, 7, 8], [9, 15, 2, VOCAB - 3, 4, 11]])
    full = Embed()
    sharded = compare_twins(rank, full, {"embed_tokens": style}, [ids])
    # the padding row gets no gradient on the rank that holds it, in both twins
    assert torch.count_nonzero(full.embed_tokens.weight.grad[VOCAB - 3]) == 0
    assert sharded.embed_tokens.weight.grad.full_tensor()[VOCAB - 3].abs().max() == 0


def check_replicated_with_grad_allreduce(rank):
    """q_norm between colwise q_proj and rowwise o_proj: its weight gradient is summed over the ranks' heads."""
    torch.manual_seed(0)
    rules = {"q_proj": "colwise", "q_norm": "replicated_with_grad_allreduce", "o_proj": "rowwise"}
    compare_twins(rank, HeadNormAttention(), rules, [hidden(BATCH, SEQ, H)])


def check_plain_q_norm_gets_a_partial_gradient(rank):
    """Without the style, q_norm's gradient covers only this rank's heads: it must differ from the full one."""
    torch.manual_seed(0)
    full = HeadNormAttention()
    sharded = compare_twins(
        rank, full, {"q_proj": "colwise", "o_proj": "rowwise"}, [hidden(SEQ, H)], expect_grads=False
    )
    diff = (sharded.q_norm.weight.grad - full.q_norm.weight.grad).abs().max().item()
    assert diff > 1e-3, f"a plain replicated q_norm should get a partial gradient, diff {diff}"


def check_sequence_parallel(rank):
    """A norm on this rank's part of the sequence [B, S/tp, H]; its weight gradient sums over all tokens."""
    torch.manual_seed(0)
    norm = nn.RMSNorm(H)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    compare_twins(
        rank,
        nn.Sequential(norm),
        {"0": "sequence_parallel"},
        [hidden(BATCH, SEQ, H)],
        split_inputs={0: 1},
        split_output=1,
    )


def check_all_reduce(rank):
    """A hand-written projection whose weight is split on its input features: all_reduce sums its partial output."""
    torch.manual_seed(0)
    rules = {"up": "colwise", "project.weight": "rowwise", "project": "all_reduce"}
    compare_twins(rank, PartialBlock(), rules, [hidden(BATCH, SEQ, H)])


def check_local_params(rank):
    """Attention sinks: a bare parameter split per head by its own rule, used by its owner on local heads."""
    torch.manual_seed(0)
    rules = {"q_proj": "colwise", "sink.sinks": "colwise", "sink": "local_params", "o_proj": "rowwise"}
    compare_twins(rank, SinkAttention(), rules, [hidden(BATCH, SEQ, H)])


def check_mla_kv_a_proj(rank, with_style):
    torch.manual_seed(0)
    rules = {"kv_b_proj": "colwise", "q_proj": "colwise", "o_proj": "rowwise"}
    if with_style:
        rules["kv_a_proj_with_mqa"] = "mla_kv_a_proj"
    full = MlaAttention()
    sharded = compare_twins(rank, full, rules, [hidden(BATCH, SEQ, H)], expect_grads=with_style)
    if not with_style:
        got, want = sharded.kv_a_proj_with_mqa.weight.grad, full.kv_a_proj_with_mqa.weight.grad
        rope_rows = slice(MlaAttention.LORA, None)
        diff = (got[rope_rows] - want[rope_rows]).abs().max().item()
        assert diff > 1e-3, f"without mla_kv_a_proj the RoPE rows' gradient should be partial, diff {diff}"


def check_inference_without_grad(rank):
    """Under no_grad the styles give the same outputs (the layout changes take no autograd path)."""
    torch.manual_seed(0)
    full = HeadNormAttention()
    sharded = rank.sharded_twin(
        full, {"q_proj": "colwise", "q_norm": "replicated_with_grad_allreduce", "o_proj": "rowwise"}
    )
    x = hidden(3, H)
    with torch.no_grad():
        rank.expect_close("no_grad output", sharded(x), full(x))


# --- tests --------------------------------------------------------------------------------------


def test_colwise_then_rowwise(tp2):
    tp2.run(check_colwise_rowwise, "colwise", "rowwise")


@pytest.mark.parametrize("style", ["colwise_gather_output", "colwise_rep"])
def test_colwise_with_gathered_output(tp2, style):
    tp2.run(check_gathered_colwise, style)


def test_colwise_output_stays_local(tp2):
    tp2.run(check_local_colwise)


def test_rowwise_with_sharded_input(tp2):
    tp2.run(check_rowwise_sharded_input)


@pytest.mark.parametrize("style", ["rowwise_split_input", "rowwise_rep"])
def test_rowwise_with_replicated_input(tp2, style):
    tp2.run(check_rowwise_replicated_input, style)


def test_rowwise_reduce_scatters_to_a_sequence_shard(tp2):
    tp2.run(check_rowwise_reduce_scatter)


def test_packed_colwise_keeps_chunks_aligned(tp2):
    tp2.run(check_packed_colwise)


def test_packed_colwise_split_factor(tp2):
    tp2.run(check_packed_colwise_split_factor_3)


def test_plain_colwise_on_a_packed_weight_is_wrong(tp2):
    tp2.run(check_packed_colwise_plain_shard_misaligns)


@pytest.mark.parametrize("style", ["embedding_rowwise", "embedding_colwise"])
def test_embedding(tp2, style):
    tp2.run(check_embedding, style)


def test_replicated_with_grad_allreduce_gives_full_q_norm_gradient(tp2):
    tp2.run(check_replicated_with_grad_allreduce)


def test_q_norm_without_the_style_gets_a_partial_gradient(tp2):
    tp2.run(check_plain_q_norm_gets_a_partial_gradient)


def test_sequence_parallel(tp2):
    tp2.run(check_sequence_parallel)


def test_all_reduce(tp2):
    tp2.run(check_all_reduce)


def test_local_params(tp2):
    tp2.run(check_local_params)


@pytest.mark.parametrize("with_style", [True, False], ids=["styled", "unstyled_differs"])
def test_mla_kv_a_proj(tp2, with_style):
    tp2.run(check_mla_kv_a_proj, with_style)


def test_inference_without_grad(tp2):
    tp2.run(check_inference_without_grad)


# --- registration and validation (driver side: no process group) ------------------------------


# Every style name of the SPEC §4 table (the DeepGEMM Mega-MoE variants of STYLE-3 need that GPU kernel).
SPEC_STYLE_NAMES = (
    "embedding_rowwise",
    "embedding_colwise",
    "colwise",
    "colwise_gather_output",
    "colwise_rep",
    "rowwise",
    "rowwise_split_input",
    "rowwise_rep",
    "packed_colwise",
    "packed_rowwise",
    "sequence_parallel",
    "replicated_with_grad_allreduce",
    "mla_kv_a_proj",
    "all_reduce",
    "moe_tp_experts",
    "moe_identity_expert",
    "local_params",
    "grouped_gemm",
    "ep_router",
    "ep_dispatch_experts",
)


def test_every_spec_style_is_registered():
    assert set(STYLES) == set(SPEC_STYLE_NAMES)
    for name in STYLES:
        assert isinstance(STYLES.get(name), ParallelStyle)


def meta(module_fn):
    with torch.device("meta"):
        return module_fn()


@pytest.mark.parametrize(
    ("style", "module_fn", "param", "mesh_size", "message"),
    [
        (
            "colwise",
            lambda: nn.Linear(8, 12),
            "weight",
            5,
            r"weight \(12, 8\): dim 0 has size 12; .* into 5 equal parts",
        ),
        ("colwise", lambda: nn.Linear(8, 12), "bias", 5, r"bias \(12,\): dim 0 has size 12"),
        ("rowwise", lambda: nn.Linear(6, 8), "weight", 4, r"weight \(8, 6\): dim 1 has size 6"),
        ("embedding_rowwise", lambda: nn.Embedding(10, 8), "weight", 4, r"weight \(10, 8\): dim 0 has size 10"),
        ("embedding_colwise", lambda: nn.Embedding(8, 6), "weight", 4, r"weight \(8, 6\): dim 1 has size 6"),
        ("packed_colwise", lambda: nn.Linear(8, 12), "weight", 4, r"weight \(12, 8\): .*2 packed pieces of 6"),
        ("packed_rowwise", lambda: nn.Linear(12, 8), "weight", 4, r"weight \(8, 12\): dim 1 .*2 packed pieces of 6"),
    ],
)
def test_validate_rejects_uneven_splits(style, module_fn, param, mesh_size, message):
    module = meta(module_fn)
    with pytest.raises(ValueError, match=message):
        STYLES.get(style).validate_param(module, param, getattr(module, param), mesh_size)


def test_validate_accepts_even_splits():
    module = meta(lambda: nn.Linear(8, 12))
    for style in ("colwise", "rowwise", "colwise_rep", "rowwise_rep"):
        STYLES.get(style).validate_param(module, "weight", module.weight, 2)
    STYLES.get("packed_colwise").validate_param(module, "weight", module.weight, 3)  # 12 = 2 pieces of 3 * 2


def test_validate_rejects_splitting_a_head():
    """24 output features of 3 heads of 8 split 4 ways per rank: divisible by 2, but not in whole heads."""
    module = meta(lambda: nn.Linear(8, 24))
    module.tp_block_size = 8
    with pytest.raises(ValueError, match=r"weight \(24, 8\): dim 0 has size 24, in blocks of 8 .*into 2 equal parts"):
        STYLES.get("colwise").validate_param(module, "weight", module.weight, 2)
    STYLES.get("colwise").validate_param(module, "weight", module.weight, 3)


def test_validate_rejects_expert_weights_with_an_uneven_intermediate_dim():
    with torch.device("meta"):
        gate_up = torch.empty(4, 2 * 6, 8)  # [E, 2I, H], INTER = 6 does not split 4 ways
    with pytest.raises(ValueError, match=r"gate_up_proj \(4, 12, 8\): dim 1 .*2 packed pieces of 6"):
        STYLES.get("packed_colwise").validate_param(nn.Module(), "gate_up_proj", gate_up, 4)


def test_validate_rejects_embedding_max_norm_and_missing_mla_rope_dim():
    emb = meta(lambda: nn.Embedding(8, 8, max_norm=1.0))
    with pytest.raises(ValueError, match="max_norm"):
        STYLES.get("embedding_rowwise").validate_param(emb, "weight", emb.weight, 2)
    proj = meta(lambda: nn.Linear(8, 8))
    with pytest.raises(ValueError, match=r"mla_kv_a_proj needs Linear.qk_rope_head_dim"):
        STYLES.get("mla_kv_a_proj").validate_param(proj, "weight", proj.weight, 2)
    proj.qk_rope_head_dim = 8
    with pytest.raises(ValueError, match=r"weight \(8, 8\): expected \[kv_lora_rank \+ qk_rope_head_dim"):
        STYLES.get("mla_kv_a_proj").validate_param(proj, "weight", proj.weight, 2)


def test_validate_runs_in_resolve_plans_before_any_weight_is_read():
    """Through the driver-side plan resolution, on a meta model: the error names the rule, parameter and shapes."""
    from raymoe import DistributedConfig
    from raymoe.spec.plans import DefaultPlans, resolve_plans

    model = meta(HeadNormAttention)
    plans = DefaultPlans(tp={"q_proj": "colwise", "o_proj": "rowwise"})
    resolve_plans(model, plans, DistributedConfig(tp_size=2, fsdp_size=1))
    with pytest.raises(
        ValueError, match=r"tp_plan rule 'q_proj' -> 'colwise' cannot shard weight \(16, 8\) over tp_size=8"
    ):
        resolve_plans(model, plans, DistributedConfig(tp_size=8, fsdp_size=1))
