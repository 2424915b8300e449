"""Token streams into fixed-length rows, packing windows (``pack_window``), and held-out splits of packed rows."""

import json

import pytest
import torch

from raymoe.driver.dataset import load_dataset
from raymoe.driver.packing import PackedData, pack_token_stream
from raymoe.driver.tiny import tiny_tokenizer


def test_pack_token_stream_joins_with_eos_and_pads_the_last_row():
    data = pack_token_stream([[1] * 5, [2] * 9, [3] * 3], seq_len=8, eos_token_id=9, pad_token_id=0)
    assert data.input_ids.tolist() == [
        [1, 1, 1, 1, 1, 9, 2, 2],
        [2, 2, 2, 2, 2, 2, 2, 9],
        [3, 3, 3, 9, 0, 0, 0, 0],
    ]
    assert data.attention_mask.tolist() == [[1] * 8, [1] * 8, [1, 1, 1, 1, 0, 0, 0, 0]]
    assert data.num_tokens == 20 and data.seq_len == 8


def test_pack_drops_a_last_row_without_a_target_and_rejects_empty_input():
    data = pack_token_stream([[1] * 8], seq_len=8, eos_token_id=9)  # 9 tokens: the 9th alone has no next token
    assert data.num_sequences == 1 and data.input_ids[0].tolist() == [1] * 8
    with pytest.raises(ValueError, match="empty"):
        pack_token_stream([[], []], seq_len=8, eos_token_id=None)
    with pytest.raises(ValueError, match=r"seq_len=1 must be an int >= 2"):
        pack_token_stream([[1, 2]], seq_len=1, eos_token_id=None)


def test_split_holds_out_the_last_rows():
    data = PackedData.from_rows(torch.arange(40).view(10, 4))
    train, held_out = data.split(0.2)
    assert train.num_sequences == 8 and held_out is not None and held_out.input_ids[0, 0].item() == 32
    assert data.split(0)[1] is None
    with pytest.raises(ValueError, match=r"eval_fraction=1.5 must be in \[0, 1\)"):
        data.split(1.5)


def _conversations(count: int) -> list[dict]:
    """Conversations of varied lengths (so that best-fit places them out of order)."""
    return [
        {
            "messages": [
                {"role": "user", "content": "q" * (i * 7 % 23 + 1)},
                {"role": "assistant", "content": "a" * (i * 5 % 17 + 1)},
            ]
        }
        for i in range(count)
    ]


def _write_jsonl(path, records) -> object:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.mark.parametrize("kind", ["chat", "text"])
def test_a_pack_window_packs_each_window_alone_and_none_is_the_whole_dataset(tmp_path, kind):
    tokenizer = tiny_tokenizer()
    records = _conversations(50)
    if kind == "text":
        records = [{"text": r["messages"][0]["content"] + " " + r["messages"][1]["content"]} for r in records]
    path = _write_jsonl(tmp_path / "all.jsonl", records)
    whole = load_dataset(path, 96, tokenizer, cache_dir=False)
    assert _equal(load_dataset(path, 96, tokenizer, cache_dir=False, pack_window=None), whole)
    assert _equal(load_dataset(path, 96, tokenizer, cache_dir=False, pack_window=50), whole)  # one window: the same

    windowed = load_dataset(path, 96, tokenizer, cache_dir=False, pack_window=16)
    alone = [
        load_dataset(_write_jsonl(tmp_path / f"w{at}.jsonl", records[at : at + 16]), 96, tokenizer, cache_dir=False)
        for at in range(0, 50, 16)
    ]
    for name in ("input_ids", "attention_mask", "labels"):
        parts = [getattr(part, name) for part in alone]
        assert (getattr(windowed, name) is None) == (parts[0] is None)
        if parts[0] is not None:
            assert torch.equal(getattr(windowed, name), torch.cat(parts)), name
    # document ids go on from window to window: each window's ids offset by the examples before it
    offsets = [0, 16, 32, 48]
    shifted = [torch.where(p.document_ids >= 0, p.document_ids + o, -1) for p, o in zip(alone, offsets, strict=True)]
    assert torch.equal(windowed.document_ids, torch.cat(shifted))
    assert windowed.report.examples == 50 and windowed.report.rows == windowed.num_sequences
    assert not _equal(windowed, whole)  # the windows are seen: rows end at each window's end


def _equal(a: PackedData, b: PackedData) -> bool:
    return all(
        (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
        for x, y in ((a.input_ids, b.input_ids), (a.attention_mask, b.attention_mask), (a.labels, b.labels))
    ) and torch.equal(a.document_ids, b.document_ids)


def test_bad_pack_windows_are_one_clear_error(tmp_path):
    path = _write_jsonl(tmp_path / "a.jsonl", _conversations(4))
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match=r"pack_window=.* must be None \(the whole dataset\) or an int >= 1"):
            load_dataset(path, 96, tiny_tokenizer(), pack_window=bad)
