"""The Ray Data engine's operators without Ray: a batch of records tokenized, windows packed and Ray Data blocks
of windows made into the ranks' blocks give what the driver engine gives for the same records; a block's rows are
the targets train_step trains on, and its statistics count what train_step counts."""

from __future__ import annotations

import json

import pyarrow as pa
import torch

from raymoe.driver.data_operators import BlockOperator, PackOperator, TokenizeOperator
from raymoe.driver.dataset import load_dataset
from raymoe.driver.example_encoder import EncodeOptions, ExampleEncoder
from raymoe.driver.streamed_data import StreamedData
from raymoe.driver.tiny import tiny_tokenizer


def _chat(count: int) -> list[dict]:
    return [
        {
            "messages": [
                {"role": "user", "content": "q" * (i * 7 % 23 + 1)},
                {"role": "assistant", "content": "a" * (i % 9 + 1)},
            ]
        }
        for i in range(count)
    ]


def test_operators_on_windows_give_the_driver_engines_rows(tmp_path):
    tokenizer = tiny_tokenizer()
    records = _chat(30)
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    reference = load_dataset(path, 96, tokenizer, cache_dir=False, pack_window=8)
    encoder = ExampleEncoder(
        tokenizer.tokenizer, tokenizer.eos_token_id, tokenizer.chat_template, "chat", EncodeOptions(), "x"
    )
    tokenize = TokenizeOperator(encoder, "json_lines")
    lines = pa.table({"text": [json.dumps(r) for r in records]})
    examples = pa.concat_tables([tokenize(lines.slice(0, 13)), tokenize(lines.slice(13))])
    pack = PackOperator("chat", "x", 96, "document", "error")
    windows = [pack(examples.slice(at, 8)) for at in range(0, 30, 8)]
    # Ray Data blocks of 1, 2 and 1 windows, and one of them sliced out of a larger table
    tables = [windows[0], pa.concat_tables(windows[1:3]), pa.concat_tables(windows[2:]).slice(1)]
    made = [BlockOperator(96)(table) for table in tables]
    assert [s.window_sizes for _, s in made] == [(8,), (8, 8), (6,)]
    data = StreamedData.of_blocks([b for b, _ in made], [s for _, s in made], 96, lambda refs: refs, has_labels=True)
    assert data.num_sequences == reference.num_sequences
    assert data.num_label_tokens == reference.num_label_tokens
    collected = data.collect()
    for name in ("input_ids", "attention_mask", "document_ids"):
        assert torch.equal(getattr(collected, name), getattr(reference, name)), name
    assert torch.equal(collected.labels, reference.targets())
    assert torch.equal(collected.targets(), reference.targets())
    assert data.id_range == (int(reference.input_ids.min()), int(reference.input_ids.max()))
