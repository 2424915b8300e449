"""Attention across a sequence split over cp ranks (issue 32): the head-tail split, the ring and the all-to-all equal
attention over whole rows in one process, outputs and every gradient, for the variants the families need (grouped
kv heads, sliding windows, sinks, value heads narrower than query heads as MLA has, packed documents that cross
chunk boundaries)."""

import pytest
import torch

from raymoe.models.common.packing import pack_documents
from raymoe.models.common.row_attention import AttentionRule, attend_rows
from raymoe.parallel.context_parallel.chunks import HeadTail
from raymoe.parallel.context_parallel.ring import step_blocks
from raymoe.parallel.context_parallel.split import document_runs

# --- the split, in one process -------------------------------------------------------------------------------------


def test_head_tail_gives_each_rank_an_early_and_a_late_chunk():
    rows = torch.arange(16).view(1, 16)
    shares = [HeadTail(4, r, 16).cut(rows) for r in range(4)]
    assert [s.tolist()[0] for s in shares] == [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]
    assert torch.equal(HeadTail(4, 0, 16).restore(shares), rows)
    assert HeadTail(2, 1, 8).token_index().tolist() == [2, 3, 4, 5]


def test_a_row_that_does_not_cut_into_2cp_chunks_is_refused():
    with pytest.raises(ValueError, match=r"sequence of 10 tokens does not split over cp_size=4.*multiple of 8"):
        HeadTail(4, 0, 10)


def test_ring_blocks_skip_what_causality_and_the_window_hide():
    chunks = HeadTail(2, 0, 8)  # rank 0 holds chunks 0 and 3 of 4 (c = 2)
    own = {(b.q_chunk, b.k_chunk, b.causal) for b in step_blocks(chunks, 0, None)}
    assert own == {(0, 0, True), (3, 0, False), (3, 3, True)}  # chunk 3 of the keys is after query chunk 0
    other = {(b.q_chunk, b.k_chunk) for b in step_blocks(chunks, 1, None)}  # keys of rank 1: chunks 1 and 2
    assert other == {(3, 1), (3, 2)}
    windowed = {(b.q_chunk, b.k_chunk, b.windowed) for b in step_blocks(chunks, 1, 2)}
    assert windowed == {(3, 2, True)}  # chunk 1 lies beyond a window of 2 from every query of chunk 3


def test_document_runs_number_runs_and_restart_positions():
    ids = torch.tensor([[7, 7, 7, 2, 2, 7, 9, 9]])
    runs, positions = document_runs(ids)
    assert runs.tolist() == [[1, 1, 1, 2, 2, 3, 4, 4]]
    assert positions.tolist() == [[0, 1, 2, 0, 1, 0, 0, 1]]
    assert torch.equal(positions, pack_documents(ids).positions_BS)


# --- across ranks: gloo, 4 processes ----------------------------------------------------------------------------------

VARIANTS = {
    "gqa": dict(window=None, sinks=False, documents=False, value_dim=8),
    "window-sinks": dict(window=3, sinks=True, documents=False, value_dim=8),
    "mla-values": dict(window=None, sinks=False, documents=False, value_dim=5),
    "documents": dict(window=None, sinks=False, documents=True, value_dim=8),
    "documents-window-sinks": dict(window=3, sinks=True, documents=True, value_dim=8),
}
LAYOUTS = {2: {"cp_size": 2, "fsdp_size": 2}, 4: {"cp_size": 4}}


def _inputs(variant: dict, full: int):
    gen = torch.Generator().manual_seed(3)
    rows, heads, kv_heads, dim = 2, 4, 2, 8
    q = torch.randn(rows, heads, full, dim, generator=gen)
    k = torch.randn(rows, kv_heads, full, dim, generator=gen)
    v = torch.randn(rows, kv_heads, full, variant["value_dim"], generator=gen)
    grad = torch.randn(rows, heads, full, variant["value_dim"], generator=gen)
    sinks = torch.randn(heads, generator=gen) if variant["sinks"] else None
    # documents of 5, 1, 7 and 3 tokens (row 0) and 2, 9, 5 (row 1): every boundary falls inside a chunk of 2 or 4
    documents = (
        torch.tensor([[0] * 5 + [1] + [2] * 7 + [3] * 3, [4] * 2 + [5] * 9 + [6] * 5]) if variant["documents"] else None
    )
    return q, k, v, grad, sinks, documents


def _attend_split(rank, cp: int, mode: str, variant_name: str) -> None:
    from raymoe.parallel.context_parallel.split import ContextSplit

    variant = VARIANTS[variant_name]
    ctx = rank.context(**LAYOUTS[cp])
    split = ContextSplit(ctx.mesh("cp"), mode)
    full = 16
    q, k, v, grad, sinks, documents = _inputs(variant, full)
    scale = 0.4

    # the reference: whole rows in one process
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_sinks = sinks.clone().requires_grad_() if sinks is not None else None
    rule = AttentionRule(scale, variant["window"], ref_sinks)
    whole_rows = pack_documents(documents).attend if documents is not None else attend_rows
    want = whole_rows(*leaves, rule)
    want.backward(grad)

    mine = [split.cut(t, dim=2).clone().requires_grad_() for t in (q, k, v)]
    my_sinks = sinks.clone().requires_grad_() if sinks is not None else None
    layout = split.layout(documents, q.shape[0], full, q.device)
    if documents is not None:
        assert torch.equal(layout.positions_BS, split.cut(pack_documents(documents).positions_BS))
    got = layout.attend(*mine, AttentionRule(scale, variant["window"], my_sinks))
    rank.expect_close("out", got, split.cut(want, dim=2))
    got.backward(split.cut(grad, dim=2))
    for name, param, leaf in zip("qkv", mine, leaves, strict=True):
        rank.expect_close_rel(f"grad {name}", param.grad, split.cut(leaf.grad, dim=2))
    if sinks is not None:
        total = split.sum(my_sinks.grad.clone())  # each rank's rows (ring) or heads (all-to-all) add their share
        rank.expect_close_rel("grad sinks", total, ref_sinks.grad)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("mode", ["ring", "all_to_all"])
@pytest.mark.parametrize("cp", [2, 4])
def test_attention_across_the_split_equals_whole_rows(world4, cp, mode, variant):
    world4.run(_attend_split, cp, mode, variant)


def _gather_and_cut(rank) -> None:
    from raymoe.parallel.context_parallel.split import ContextSplit

    split = ContextSplit(rank.context(cp_size=4).mesh("cp"), "ring")
    rows = torch.arange(3 * 16 * 2).view(3, 16, 2).float()
    mine = split.cut(rows)
    assert torch.equal(split.gather(mine), rows)
    first = split.gather_to_first(mine)
    assert (first is None) == (rank.rank != 0)
    assert first is None or torch.equal(first, rows)


def test_gather_puts_every_share_back_in_row_order(world4):
    world4.run(_gather_and_cut)


def test_the_cuda_kernels_output_is_handed_back_laid_out_as_the_kernel_wrote_it():
    """The memory-efficient CUDA backward reads the block's output at a row stride of heads x width whatever its
    strides say (an H200 gave wrong bf16 dq/dk and, at 8k rows, an illegal access for ``[B, H, c, D]`` memory):
    ``_rows_outer`` keeps the values and lays them out ``[B, c, H, D]``."""
    from raymoe.parallel.context_parallel.ring import _rows_outer

    out = torch.randn(2, 8, 96, 64)  # [B, H, c, D], contiguous as the ring's merge leaves it
    laid = _rows_outer(out)
    assert torch.equal(laid, out)
    assert laid.stride() == (96 * 8 * 64, 64, 8 * 64, 1)
