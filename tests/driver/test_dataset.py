"""Dataset files on the driver: JSONL, text and .npy in, packed rows out; bad files are one clear error."""

import json

import numpy as np
import pytest

from raymoe.driver.dataset import load_dataset
from raymoe.driver.tokenizer import TextTokenizer


def test_jsonl_text_and_npy_datasets(tmp_path):
    tokenizer = TextTokenizer.byte_level()
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text(json.dumps({"text": "abc", "id": 1}) + "\n\n" + json.dumps("de") + "\n")
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
