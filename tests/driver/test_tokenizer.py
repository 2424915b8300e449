"""The model's tokenizer on the driver: byte-level ids, tokenizer.json round trips, clear errors."""

import pytest

from raymoe.driver.tokenizer import TextTokenizer, load_tokenizer


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
