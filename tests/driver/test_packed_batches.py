"""Document-masked packed batches on 4 ranks (tp2 x fsdp2, fsdp2 x ep2, and context parallelism: cp2 x fsdp2,
cp4, cp2 x tp2 all-to-all) against transformers in one process.

gpt-oss covers the attention variants that must act inside each document: sliding windows, attention sinks
(split over tp with their heads) and routed experts dispatched over ep. The reference runs every document alone.
Under context parallelism the rows' 24 tokens are cut into chunks of 6 (cp2) or 3 (cp4): every row has documents
that cross chunk boundaries, so a document's tokens sit on several ranks and attend across them.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from raymoe.driver.batch import make_global_batch

FAMILY = "gptoss_e4_k3_gqa2_window5"
LR = 1e-2
SEQ = 24
# Each row: its documents' lengths; the rest of the row is right padding (rows 1 and 3).
ROWS = [(7, 11, 6), (9, 3, 8), (12, 12), (1, 14, 5)]


def packed_batch(vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.zeros((len(ROWS), SEQ), dtype=torch.int64)
    mask = torch.zeros_like(ids)
    documents = torch.full_like(ids, -1)
    alone = []
    for row, lengths in enumerate(ROWS):
        start = 0
        for doc, length in enumerate(lengths):
            tokens = torch.randint(0, vocab, (length,), generator=generator)
            ids[row, start : start + length] = tokens
            mask[row, start : start + length] = 1
            documents[row, start : start + length] = doc
            alone.append(tokens)
            start += length
    return ids, mask, documents, alone


def reference_loss(hf_model, documents: list[torch.Tensor]) -> tuple[torch.Tensor, int]:
    """Summed next-token loss of every document run alone, and the number of targets."""
    total, count = torch.zeros(()), 0
    for tokens in documents:
        if len(tokens) < 2:
            continue
        logits = hf_model(input_ids=tokens[None]).logits[0, :-1]
        total = total + F.cross_entropy(logits.float(), tokens[1:], reduction="sum")
        count += len(tokens) - 1
    return total, count


@pytest.mark.parametrize(
    "config",
    [
        {"tp_size": 2, "fsdp_size": 2},
        {"fsdp_size": 2, "ep_size": 2, "dp_replicate_size": 2},
        {"cp_size": 2, "fsdp_size": 2, "ep_size": 2},
        {"cp_size": 4},
        {"cp_size": 2, "tp_size": 2, "cp_mode": "all_to_all"},
    ],
    ids=["tp2_fsdp2", "fsdp2_ep2", "cp2_fsdp2_ep2", "cp4", "cp2_tp2_all_to_all"],
)
def test_packed_batches_train_as_each_document_alone(load_on_world, tiny_checkpoint, load_hf_model, config):
    directory = tiny_checkpoint(FAMILY)
    hf_model = load_hf_model(directory).train()
    vocab = hf_model.config.vocab_size
    batches = [packed_batch(vocab, seed) for seed in (0, 1)]
    optimizer = torch.optim.AdamW(hf_model.parameters(), lr=LR, weight_decay=0.0)
    expected = []
    for _, _, _, alone in batches:
        total, count = reference_loss(hf_model, alone)
        (total / count).backward()
        optimizer.step()
        optimizer.zero_grad()
        expected.append(((total / count).item(), count))

    with load_on_world(directory, config) as model:
        ids, mask, documents, alone = batches[0]
        logits = model(ids, document_ids=documents)
        hf_model.eval()
        fresh = load_hf_model(directory)
        with torch.no_grad():
            start = 0
            for tokens in alone[:3]:  # row 0's documents
                want = fresh(input_ids=tokens[None]).logits[0]
                assert (logits[0, start : start + len(tokens)] - want).abs().max().item() <= 1e-5
                start += len(tokens)
            plain = model(ids)
        assert (plain[0, 7:24] - logits[0, 7:24]).abs().max().item() > 1e-3  # the mask is what matters

        evaluated = model.evaluate(ids, attention_mask=mask, document_ids=documents)
        assert evaluated["num_tokens"] == expected[0][1]
        assert evaluated["loss"] == pytest.approx(expected[0][0], rel=1e-5)

        model.configure_training(lr=LR, weight_decay=0.0, betas=(0.9, 0.999), max_grad_norm=None, balance="none")
        accumulate = len(ROWS) // model.topology.config.dp_size  # the second step accumulates one row at a time
        for step, (ids, mask, documents, _) in enumerate(batches):
            micro = accumulate if step else 1
            metrics = model.train_step(ids, attention_mask=mask, document_ids=documents, micro_batches=micro)
            want_loss, want_count = expected[step]
            assert metrics["num_tokens"] == want_count
            # step 1 runs on weights the first step moved: equal only if the gradients were
            assert metrics["lm_loss"] == pytest.approx(want_loss, rel=1e-4), (step, metrics["lm_loss"], want_loss)


def test_document_ids_are_checked_and_mask_document_starts_on_the_driver():
    """What ``train_step`` / ``evaluate`` / ``model(...)`` do with ``document_ids`` before any rank is asked."""
    ids = torch.arange(12).view(2, 6)
    documents = torch.tensor([[0, 0, 1, 1, 1, 2], [5, 5, 5, 5, -1, -1]])
    mask = torch.tensor([[1] * 6, [1, 1, 1, 1, 0, 0]])
    batch = make_global_batch(ids, None, mask, vocab_size=96, document_ids=documents)
    # no token predicts the first token of the next document; padding takes no loss either
    assert batch.labels.tolist() == [[0, 1, -100, 3, 4, -100], [6, 7, 8, 9, -100, -100]]
    assert batch.num_label_tokens == 3 + 3 and torch.equal(batch.document_ids, documents)
    with pytest.raises(ValueError, match=r"document_ids must be a tensor shaped like input_ids \(2, 6\), got \(2, 5\)"):
        make_global_batch(ids, None, None, 96, document_ids=torch.zeros((2, 5), dtype=torch.int64))
    with pytest.raises(ValueError, match=r"document_ids must hold integer document ids, got dtype torch.float32"):
        make_global_batch(ids, None, None, 96, document_ids=torch.zeros((2, 6)))
    every_token_a_document = make_global_batch(ids, None, None, 96, document_ids=torch.arange(12).view(2, 6))
    assert every_token_a_document.num_label_tokens == 0  # train_step refuses such a batch: nothing to predict
