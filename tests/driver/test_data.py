"""Driver-side training pieces without Ray: tokenizers, packing, dataset files, LR schedule, metrics, tiny model."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest
import torch

import raymoe
from raymoe.driver.data import PackedData, TextTokenizer, load_dataset, load_tokenizer, pack_documents, read_documents
from raymoe.driver.metrics import MetricsLog, plot_metrics, read_metrics
from raymoe.driver.schedule import WarmupCosine
from raymoe.driver.tiny import TINY_MOE_CONFIG
from raymoe.driver.trainer import TrainerConfig

# --- tokenizers -------------------------------------------------------------------------------


def test_byte_level_tokenizer_ids_are_the_utf8_bytes(tmp_path):
    tokenizer = TextTokenizer.byte_level()
    text = "Hello, wörld! 日本\n\t x"
    assert tokenizer.encode(text) == list(text.encode("utf-8"))
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.eos_token_id == 256 and tokenizer.vocab_size == 260
    assert tokenizer.encode("a<|endoftext|>b") == [97, 256, 98]
    assert tokenizer.encode("<|im_start|>a<|im_end|>") == [258, 97, 259]  # the chat turn markers
    # saved as a plain tokenizer.json that the tokenizers package loads back identically
    loaded = load_tokenizer(tokenizer.save(tmp_path).parent)
    assert loaded.encode(text) == tokenizer.encode(text) and loaded.eos_token_id == 256


def test_load_tokenizer_needs_a_tokenizer_json(tmp_path):
    with pytest.raises(ValueError, match=r"no tokenizer.json in .*add it, or give pre-tokenized data"):
        load_tokenizer(tmp_path)


# --- packing ----------------------------------------------------------------------------------


def test_pack_documents_joins_with_eos_and_pads_the_last_row():
    data = pack_documents([[1] * 5, [2] * 9, [3] * 3], seq_len=8, eos_token_id=9, pad_token_id=0)
    assert data.input_ids.tolist() == [
        [1, 1, 1, 1, 1, 9, 2, 2],
        [2, 2, 2, 2, 2, 2, 2, 9],
        [3, 3, 3, 9, 0, 0, 0, 0],
    ]
    assert data.attention_mask.tolist() == [[1] * 8, [1] * 8, [1, 1, 1, 1, 0, 0, 0, 0]]
    assert data.num_tokens == 20 and data.seq_len == 8


def test_pack_drops_a_last_row_without_a_target_and_rejects_empty_input():
    data = pack_documents([[1] * 8], seq_len=8, eos_token_id=9)  # 9 tokens: the 9th alone has no next token
    assert data.num_sequences == 1 and data.input_ids[0].tolist() == [1] * 8
    with pytest.raises(ValueError, match="empty"):
        pack_documents([[], []], seq_len=8, eos_token_id=None)
    with pytest.raises(ValueError, match=r"seq_len=1 must be an int >= 2"):
        pack_documents([[1, 2]], seq_len=1, eos_token_id=None)


def test_split_holds_out_the_last_rows():
    data = PackedData.from_rows(torch.arange(40).view(10, 4))
    train, held_out = data.split(0.2)
    assert train.num_sequences == 8 and held_out is not None and held_out.input_ids[0, 0].item() == 32
    assert data.split(0)[1] is None
    with pytest.raises(ValueError, match=r"eval_fraction=1.5 must be in \[0, 1\)"):
        data.split(1.5)


# --- dataset files ----------------------------------------------------------------------------


def test_jsonl_text_and_npy_datasets(tmp_path):
    tokenizer = TextTokenizer.byte_level()
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text(json.dumps({"text": "abc", "id": 1}) + "\n\n" + json.dumps("de") + "\n")
    assert read_documents(jsonl) == ["abc", "de"]
    packed = load_dataset(jsonl, seq_len=4, tokenizer=tokenizer)
    assert packed.input_ids.tolist() == [[97, 98, 99, 256], [100, 101, 256, 0]]

    text = tmp_path / "d.txt"
    text.write_text("hello")
    assert load_dataset(text, seq_len=16, tokenizer=tokenizer).num_tokens == 6  # 5 bytes + eos

    stream, rows = tmp_path / "stream.npy", tmp_path / "rows.npy"
    np.save(stream, np.arange(10, dtype=np.int32))
    np.save(rows, np.arange(12, dtype=np.int64).reshape(3, 4))
    assert load_dataset(stream, seq_len=4, tokenizer=None).input_ids.tolist()[0] == [0, 1, 2, 3]
    assert load_dataset(rows, seq_len=999, tokenizer=None).input_ids.tolist() == np.arange(12).reshape(3, 4).tolist()


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("empty.txt", "", r"empty\.txt is empty: it holds no text to train on"),
        ("blank.jsonl", "\n\n", r"blank\.jsonl is empty"),
        ("bad.jsonl", '{"text": "a"}\n{oops\n', r"bad\.jsonl line 2 is not valid JSON"),
        (
            "field.jsonl",
            '{"content": "a"}\n',
            r"field\.jsonl line 1 must be .* field 'text' \(text\), 'messages' \(a conversation\) or 'prompt' and "
            r"'completion', got an object with fields \['content'\]",
        ),
        ("latin1.txt", b"caf\xe9", r"latin1\.txt is not UTF-8 text"),
    ],
)
def test_bad_dataset_files_are_one_clear_error(tmp_path, name, content, message):
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(ValueError, match=message):
        load_dataset(path, seq_len=8, tokenizer=TextTokenizer.byte_level())


def test_missing_and_unusable_dataset_paths(tmp_path):
    with pytest.raises(ValueError, match=r"dataset file '.*absent.txt' does not exist"):
        load_dataset(tmp_path / "absent.txt", seq_len=8, tokenizer=TextTokenizer.byte_level())
    with pytest.raises(ValueError, match=r"cannot load the dataset '.*' \(split 'train'\)"):
        load_dataset(tmp_path, seq_len=8, tokenizer=None)  # a directory is a `datasets` dataset, here an empty one
    text = tmp_path / "t.txt"
    text.write_text("abc")
    with pytest.raises(ValueError, match="is text and needs a tokenizer"):
        load_dataset(text, seq_len=8, tokenizer=None)
    floats = tmp_path / "f.npy"
    np.save(floats, np.zeros(4))
    with pytest.raises(ValueError, match="integer array of token ids, got float64"):
        load_dataset(floats, seq_len=8, tokenizer=None)


# --- learning-rate schedule --------------------------------------------------------------------


def test_warmup_then_cosine_to_the_floor():
    schedule = WarmupCosine(peak_lr=1.0, total_steps=12, warmup_steps=2, min_lr_ratio=0.1)
    lrs = [schedule.lr_at(step) for step in range(14)]
    assert lrs[:3] == [0.5, 1.0, 1.0]  # warmup reaches the peak, decay starts from it
    assert all(a > b for a, b in itertools.pairwise(lrs[2:12]))  # strictly falling
    assert math.isclose(lrs[11], 0.1) and lrs[12] == lrs[13] == pytest.approx(0.1)
    assert math.isclose(lrs[2 + 9 // 2], 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 4 / 9)))
    assert WarmupCosine(2.0, total_steps=1).lr_at(0) == 2.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"peak_lr": 0.0}, r"lr=0.0 must be a number > 0"),
        ({"total_steps": 0}, r"steps=0 must be an int >= 1"),
        ({"warmup_steps": 11}, r"warmup_steps=11 must be an int in \[0, steps=10\]"),
        ({"min_lr_ratio": 2}, r"min_lr_ratio=2 must be in \[0, 1\]"),
    ],
)
def test_schedule_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        WarmupCosine(**{"peak_lr": 1e-3, "total_steps": 10, **kwargs})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"global_batch_size": 0}, r"TrainerConfig: global_batch_size=0 must be an int >= 1"),
        ({"gradient_accumulation_steps": True}, r"gradient_accumulation_steps=True must be an int >= 1"),
        ({"eval_every": 0}, r"eval_every=0 must be an int >= 1"),
        ({"lr": -1.0}, r"schedule: lr=-1.0 must be a number > 0"),
    ],
)
def test_trainer_config_rejects_bad_values(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        TrainerConfig(output_dir=tmp_path, **kwargs)
    assert TrainerConfig(output_dir=tmp_path, steps=25).schedule().warmup_steps == 2  # default: a tenth


# --- metrics ----------------------------------------------------------------------------------


def test_metrics_jsonl_and_plot(tmp_path):
    log = MetricsLog(tmp_path / "run" / "metrics.jsonl")
    log.append({"step": 0, "eval_loss": 5.5})
    for step in range(1, 6):
        log.append({"step": step, "loss": 5.0 - step, "tokens_per_s": 100.0 * step, "max_expert_imbalance": 1.5})
    assert read_metrics(log.path) == log.records and len(log.records) == 6
    png = plot_metrics(log.records, tmp_path / "run" / "metrics.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    # a new run starts a fresh file
    assert MetricsLog(log.path).records == [] and log.path.read_text() == ""


# --- the embedded tiny model --------------------------------------------------------------------


def test_tiny_checkpoint_loads_and_leaves_the_global_rng_alone(tmp_path):
    torch.manual_seed(123)
    expected = torch.rand(1)
    torch.manual_seed(123)
    directory = raymoe.build_tiny_checkpoint(tmp_path / "tiny")
    assert torch.rand(1) == expected
    assert {p.name for p in directory.iterdir()} == {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    }
    model = raymoe.load_model(directory)
    assert model.num_experts == TINY_MOE_CONFIG["num_experts"] == 8
    ids = torch.tensor([load_tokenizer(directory).encode("hello")])
    assert model(ids).shape == (1, 5, 264)
    # same seed, same weights
    again = raymoe.load_model(raymoe.build_tiny_checkpoint(tmp_path / "again"))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters(), strict=True))
