"""Document-masked packing in the model: a packed row gives every document the logits it has alone.

Positions restart at each document and attention stays inside it, under sliding windows (gpt-oss, Mixtral) and
attention sinks (gpt-oss) too; the reference is transformers running each document by itself.
"""

from __future__ import annotations

import pytest
import torch

from raymoe.checkpoint import load_model
from raymoe.models.common.kv_cache import KVCache
from raymoe.models.common.packing import pack_documents

LOGITS_ATOL = 1e-5
# Longer than every tiny sliding window (5, 6) so windows act inside documents; a 1-token document too.
DOCUMENT_LENGTHS = [(9, 1, 14, 6), (3, 17, 10)]


def _documents(vocab: int, lengths: tuple[int, ...], seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=generator) for n in lengths]


def _packed_rows(vocab: int) -> tuple[torch.Tensor, torch.Tensor, list[list[torch.Tensor]]]:
    """Two rows of 30 tokens: documents back to back, document ids, and the last row right-padded."""
    rows, ids, docs_of_row = [], [], []
    for r, lengths in enumerate(DOCUMENT_LENGTHS):
        docs = _documents(vocab, lengths, seed=r)
        row = torch.cat(docs)
        doc_ids = torch.cat([torch.full((len(d),), 100 * r + i) for i, d in enumerate(docs)])
        pad = 30 - len(row)
        rows.append(torch.cat([row, torch.zeros(pad, dtype=torch.int64)]))
        ids.append(torch.cat([doc_ids, torch.full((pad,), -1)]))
        docs_of_row.append(docs)
    return torch.stack(rows), torch.stack(ids), docs_of_row


def test_positions_restart_at_each_run_and_documents_group_by_length():
    doc_ids = torch.tensor([[7, 7, 7, 2, 2, 9], [4, 4, 5, 4, 4, 4]])
    packed = pack_documents(doc_ids)
    assert packed.positions_BS.tolist() == [[0, 1, 2, 0, 1, 0], [0, 1, 0, 0, 1, 2]]
    # equal ids in two separate runs are two documents; lengths 1 | 2 | 3 make three classes
    slots = {tuple(b.index_NL.shape): b.index_NL[b.valid_NL].tolist() for b in packed.batches}
    assert slots == {(2, 1): [5, 8], (2, 2): [3, 4, 6, 7], (2, 3): [0, 1, 2, 9, 10, 11]}
    assert sorted(packed.order.tolist()) == list(range(12)) and not packed.one_per_row
    assert pack_documents(torch.tensor([[3, 3, 3], [1, 1, 1]])).one_per_row  # plain rows: no regrouping


def test_packed_rows_match_each_document_alone_in_transformers(tiny_name, tiny_checkpoint, load_hf_model):
    directory = tiny_checkpoint(tiny_name)
    ours, reference = load_model(directory), load_hf_model(directory)
    input_ids, document_ids, docs_of_row = _packed_rows(ours.config.vocab_size)
    with torch.no_grad():
        packed = ours(input_ids, document_ids_BS=document_ids)
        plain = ours(input_ids)
        for r, docs in enumerate(docs_of_row):
            start = 0
            for doc in docs:
                expected = reference(doc[None]).logits[0]
                alone = ours(doc[None])[0]
                got = packed[r, start : start + len(doc)]
                assert (got - expected).abs().max().item() <= LOGITS_ATOL, (tiny_name, r, start)
                assert (got - alone).abs().max().item() <= LOGITS_ATOL
                start += len(doc)
    # without document ids the later documents see the earlier ones: the mask is what makes them equal
    assert (plain[0, 10:] - packed[0, 10:]).abs().max().item() > 1e-3


def test_document_masking_gradients_match_separate_documents(tiny_checkpoint):
    """The training path: the summed loss of a packed row has the gradient of the documents' separate losses."""
    from raymoe.models import causal_lm_loss

    directory = tiny_checkpoint("gptoss_e4_k3_gqa2_window5")  # window + sinks + routed experts
    packed_model, separate_model = load_model(directory).train(), load_model(directory).train()
    input_ids, document_ids, docs_of_row = _packed_rows(packed_model.config.vocab_size)
    labels = input_ids.clone()
    labels[document_ids < 0] = -100
    starts = torch.zeros_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    labels[starts] = -100  # no document predicts the first token of the next
    causal_lm_loss(packed_model(input_ids, document_ids_BS=document_ids), labels, reduction="sum").backward()
    for docs in docs_of_row:
        for doc in docs:
            causal_lm_loss(separate_model(doc[None]), doc[None], reduction="sum").backward()
    separate = dict(separate_model.named_parameters())
    for name, param in packed_model.named_parameters():
        want = separate[name].grad
        if want is None or want.norm() == 0:
            continue
        rel = ((param.grad - want).norm() / want.norm()).item()
        assert rel <= 1e-5, f"{name}: {rel:.2e}"


def test_document_ids_take_no_kv_cache(tiny_checkpoint):
    model = load_model(tiny_checkpoint("llama_mha4"))
    ids = torch.zeros((1, 4), dtype=torch.int64)
    with pytest.raises(ValueError, match="takes no KV cache"):
        model(ids, KVCache(model.config.num_hidden_layers, max_length=8), document_ids_BS=torch.zeros_like(ids))
