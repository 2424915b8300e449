"""Training data on the driver: documents and token arrays in, fixed-length packed sequences out.

    .jsonl  one JSON object per line, its text in a field (default "text"), or a JSON string
    .npy    pre-tokenized: 1-D token stream (packed here) or 2-D [N, S] already packed
    other   plain UTF-8 text; the whole file is one document

Documents are tokenized with the model's ``tokenizer.json`` (the ``tokenizers`` package) and
packed: each document is followed by the end-of-text id, the stream is cut into rows of
``seq_len`` tokens, and the last partial row is right-padded with ``attention_mask == 0``
(those positions take no loss)::

    doc A (5) | eos | doc B (9) | eos | doc C (3) | eos        seq_len = 8
    [A A A A A e B B] [B B B B B B B e] [C C C e p p p p]     p = pad, mask 0

Attention crosses document boundaries inside a row (plain packing, no per-document mask).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np
import torch
from huggingface_hub import hf_hub_download
from huggingface_hub.errors import (
    EntryNotFoundError,
    HFValidationError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
)
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from torch import Tensor

TOKENIZER_FILE = "tokenizer.json"
# The byte-level tokenizer of the embedded tiny model: ids 0-255 are the bytes themselves.
END_OF_TEXT = "<|endoftext|>"
PAD = "<|pad|>"
BYTE_SPECIAL_TOKENS = (END_OF_TEXT, PAD)  # ids 256, 257
_EOS_NAMES = (END_OF_TEXT, "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>")


class TextTokenizer:
    """A ``tokenizers.Tokenizer`` with the one special id packing needs: ``eos_token_id`` (None if unknown)."""

    def __init__(self, tokenizer: Tokenizer, eos_token_id: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.eos_token_id = eos_token_id if eos_token_id is not None else _find_eos(tokenizer)

    @classmethod
    def byte_level(cls) -> TextTokenizer:
        """UTF-8 bytes as ids 0-255, then ``<|endoftext|>`` (256, the eos) and ``<|pad|>`` (257)."""
        return cls(_byte_level_tokenizer())

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], eos_token_id: int | None = None) -> TextTokenizer:
        return cls(Tokenizer.from_file(str(path)), eos_token_id)

    @property
    def vocab_size(self) -> int:
        """Ids this tokenizer can produce (the model's vocab may be larger, e.g. padded for sharding)."""
        return int(self.tokenizer.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; no special tokens are added."""
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int] | Tensor) -> str:
        values = ids.tolist() if isinstance(ids, Tensor) else list(ids)
        return str(self.tokenizer.decode(values, skip_special_tokens=True))

    def save(self, directory: str | os.PathLike[str]) -> Path:
        """Write ``tokenizer.json`` into ``directory`` (next to a checkpoint, so it travels with it)."""
        path = Path(directory) / TOKENIZER_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        self.tokenizer.save(str(path))
        return path


@cache
def _byte_to_char() -> dict[int, str]:
    """GPT-2's printable stand-in character for every byte: what ``tokenizers``' ByteLevel step emits."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {
        **{b: chr(b) for b in printable},
        **{b: chr(256 + i) for i, b in enumerate(others)},
    }


def _byte_level_tokenizer() -> Tokenizer:
    # A BPE model without merges over the 256 byte characters is exactly a byte tokenizer.
    vocab = {char: byte for byte, char in _byte_to_char().items()}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(token, special=True) for token in BYTE_SPECIAL_TOKENS])
    return tokenizer


def _find_eos(tokenizer: Tokenizer) -> int | None:
    for name in _EOS_NAMES:
        token_id = tokenizer.token_to_id(name)
        if token_id is not None:
            return int(token_id)
    return None


def load_tokenizer(
    name_or_path: str | os.PathLike[str],
    *,
    eos_token_id: int | None = None,
    revision: str | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
) -> TextTokenizer:
    """The ``tokenizer.json`` of a checkpoint directory or hub repository (only that file is fetched)."""
    directory = Path(name_or_path).expanduser()
    if directory.is_dir():
        path = directory / TOKENIZER_FILE
        if not path.is_file():
            raise ValueError(
                f"no {TOKENIZER_FILE} in {directory}: raymoe tokenizes text with the model's tokenizer.json; "
                "add it, or give pre-tokenized data (.npy)"
            )
        return TextTokenizer.from_file(path, eos_token_id)
    try:
        cache = str(cache_dir) if cache_dir is not None else None
        file = hf_hub_download(str(name_or_path), TOKENIZER_FILE, revision=revision, cache_dir=cache)
    except (EntryNotFoundError, LocalEntryNotFoundError, RepositoryNotFoundError, HFValidationError) as exc:
        raise ValueError(
            f"cannot get {TOKENIZER_FILE} of {str(name_or_path)!r} ({type(exc).__name__}); give pre-tokenized "
            "data (.npy) or a checkpoint directory that has one"
        ) from exc
    return TextTokenizer.from_file(file, eos_token_id)


# --- packed sequences -------------------------------------------------------------------------


@dataclass(frozen=True)
class PackedData:
    """Rows of token ids ``input_ids [N, S]`` and ``attention_mask [N, S]`` (0 = right padding, no loss)."""

    input_ids: Tensor
    attention_mask: Tensor

    def __post_init__(self) -> None:
        if self.input_ids.dim() != 2 or self.input_ids.shape != self.attention_mask.shape:
            raise ValueError(
                f"PackedData: input_ids {tuple(self.input_ids.shape)} and attention_mask "
                f"{tuple(self.attention_mask.shape)} must both be [num_sequences, seq_len]"
            )

    @classmethod
    def from_rows(cls, input_ids: Tensor | np.ndarray | Sequence[Sequence[int]]) -> PackedData:
        """Already-packed rows ``[N, S]`` of token ids; every position takes a loss."""
        ids = torch.as_tensor(np.asarray(input_ids)) if not isinstance(input_ids, Tensor) else input_ids
        if ids.dim() != 2 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
            raise ValueError(
                f"pre-tokenized rows must be a 2-D integer array [N, S], got {ids.dtype} {tuple(ids.shape)}"
            )
        ids = ids.to(torch.int64)
        return cls(ids, torch.ones_like(ids))

    @property
    def num_sequences(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.input_ids.shape[1])

    @property
    def num_tokens(self) -> int:
        """Positions that hold data (mask 1)."""
        return int(self.attention_mask.sum())

    def rows(self, index: Tensor | slice) -> PackedData:
        return PackedData(self.input_ids[index], self.attention_mask[index])

    def split(self, eval_fraction: float) -> tuple[PackedData, PackedData | None]:
        """The last ``eval_fraction`` of the rows (at least one) held out for evaluation; None if 0."""
        if not 0 <= eval_fraction < 1:
            raise ValueError(f"eval_fraction={eval_fraction!r} must be in [0, 1)")
        if eval_fraction == 0:
            return self, None
        num_eval = max(1, round(self.num_sequences * eval_fraction))
        if num_eval >= self.num_sequences:
            raise ValueError(
                f"eval_fraction={eval_fraction} of {self.num_sequences} sequences leaves none to train on; "
                "use more data or a smaller eval_fraction"
            )
        return self.rows(slice(0, -num_eval)), self.rows(slice(-num_eval, None))


def pack_documents(
    documents: Iterable[Sequence[int]], seq_len: int, eos_token_id: int | None, pad_token_id: int = 0
) -> PackedData:
    """Token documents as one stream (each followed by ``eos_token_id``), cut into ``[N, seq_len]`` rows.

    The last row is right-padded with ``pad_token_id`` (any valid id: padding has mask 0, takes no
    loss and, being on the right, is attended by no real token).
    """
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 2:
        raise ValueError(f"seq_len={seq_len!r} must be an int >= 2 (a row needs an input and a next token)")
    separator = [eos_token_id] if eos_token_id is not None else []
    stream = [token for doc in documents if len(doc) for token in (*doc, *separator)]
    if len(stream) < 2:
        raise ValueError("the dataset is empty: its documents hold fewer than 2 tokens")
    num_rows = -(-len(stream) // seq_len)
    ids = torch.full((num_rows * seq_len,), pad_token_id, dtype=torch.int64)
    ids[: len(stream)] = torch.tensor(stream, dtype=torch.int64)
    mask = torch.zeros(num_rows * seq_len, dtype=torch.int64)
    mask[: len(stream)] = 1
    # A last row with one real token has no next-token target: drop it.
    if len(stream) % seq_len == 1:
        num_rows -= 1
    return PackedData(ids.view(-1, seq_len)[:num_rows], mask.view(-1, seq_len)[:num_rows])


# --- files ------------------------------------------------------------------------------------


def read_documents(path: str | os.PathLike[str], text_field: str = "text") -> list[str]:
    """The text documents of a ``.jsonl`` file (field ``text_field`` of each line) or of a plain text file."""
    file = _existing_file(path)
    if file.suffix == ".jsonl":
        return _read_jsonl(file, text_field)
    try:
        return [file.read_text(encoding="utf-8")]
    except UnicodeDecodeError as exc:
        raise ValueError(f"dataset {file} is not UTF-8 text ({exc.reason} at byte {exc.start})") from exc


def _read_jsonl(file: Path, text_field: str) -> list[str]:
    documents = []
    with file.open("rb") as raw_lines:
        for number, raw in enumerate(raw_lines, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ValueError(
                    f"dataset {file} line {number} is not UTF-8 text ({exc.reason} at byte {exc.start} of the line)"
                ) from exc
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"dataset {file} line {number} is not valid JSON: {exc.msg}") from exc
            if isinstance(record, str):
                documents.append(record)
            elif isinstance(record, dict) and isinstance(record.get(text_field), str):
                documents.append(record[text_field])
            else:
                raise ValueError(
                    f"dataset {file} line {number} must be a JSON string or an object with a string field "
                    f"{text_field!r}, got {type(record).__name__}"
                    + (f" with fields {sorted(record)}" if isinstance(record, dict) else "")
                )
    return documents


def load_token_array(path: str | os.PathLike[str]) -> np.ndarray:
    """A pre-tokenized ``.npy`` array: 1-D (a token stream) or 2-D ``[N, S]`` (packed rows) of integers."""
    file = _existing_file(path)
    try:
        array: np.ndarray = np.load(file, allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:  # not a .npy file, a truncated one, or pickled objects
        raise ValueError(f"dataset {file} is not a .npy array of token ids ({exc})") from exc
    if array.ndim not in (1, 2) or not np.issubdtype(array.dtype, np.integer):
        raise ValueError(
            f"dataset {file} must hold a 1-D or 2-D integer array of token ids, got {array.dtype} {array.shape}"
        )
    return array


def load_dataset(
    path: str | os.PathLike[str],
    seq_len: int,
    tokenizer: TextTokenizer | None,
    *,
    text_field: str = "text",
) -> PackedData:
    """Read, tokenize and pack ``path`` (see the module docstring for the formats)."""
    file = _existing_file(path)
    if file.suffix == ".npy":
        array = load_token_array(file)
        if array.size < 2:
            raise ValueError(f"dataset {file} is empty: it holds {array.size} tokens")
        if array.ndim == 2:
            data = PackedData.from_rows(array)
        else:
            eos = tokenizer.eos_token_id if tokenizer is not None else None
            data = pack_documents([array.tolist()], seq_len, eos)
    else:
        if tokenizer is None:
            raise ValueError(f"dataset {file} is text and needs a tokenizer; give one, or pre-tokenized data (.npy)")
        documents = [tokenizer.encode(text) for text in read_documents(file, text_field)]
        if sum(len(doc) for doc in documents) == 0:
            raise ValueError(f"dataset {file} is empty: it holds no text to train on")
        data = pack_documents(documents, seq_len, tokenizer.eos_token_id)
    if data.num_sequences == 0 or data.num_tokens < 2:
        raise ValueError(f"dataset {file} is empty: it holds no tokens to train on")
    return data


def _existing_file(path: str | os.PathLike[str]) -> Path:
    file = Path(path).expanduser()
    if not file.exists():
        raise ValueError(f"dataset file {str(path)!r} does not exist")
    if not file.is_file():
        raise ValueError(f"dataset {str(path)!r} is not a file")
    return file
