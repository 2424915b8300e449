"""The Ray Data engine's operators without Ray: a batch of records tokenized and a window packed give what the
driver engine gives for the same records."""

from __future__ import annotations

import json

import pyarrow as pa
import torch

from raymoe.driver.data_operators import PackOperator, TokenizeOperator, packed_windows
from raymoe.driver.dataset import load_dataset
from raymoe.driver.example_encoder import EncodeOptions, ExampleEncoder
from raymoe.driver.packing import DataReport, packed_of_windows
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
    tables = [pack(examples.slice(at, 8)) for at in range(0, 30, 8)]
    windows = packed_windows(tables, 96, 8)
    data = packed_of_windows(windows, 96, DataReport("x", "chat", "document", 0))
    for name in ("input_ids", "attention_mask", "labels", "document_ids"):
        assert torch.equal(getattr(data, name), getattr(reference, name)), name
