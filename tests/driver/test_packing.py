"""Token streams into fixed-length rows, and held-out splits of packed rows."""

import pytest
import torch

from raymoe.driver.packing import PackedData, pack_token_stream


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
