"""Training data on the driver: documents, conversations and token arrays in, fixed-length packed rows out.

    .jsonl / .parquet   one record per line / row: a document (``text``, or a bare JSON string) or a
                        conversation (``messages``, or ``prompt`` + ``completion``); field names are options
    directory, hub id   a Hugging Face ``datasets`` split of such records (optional ``datasets`` extra)
    .npy                pre-tokenized: 1-D token stream (packed here) or 2-D [N, S] already packed
    other               plain UTF-8 text; the whole file is one document

Text is tokenized with the model's ``tokenizer.json`` (the ``tokenizers`` package); conversations are
rendered with the checkpoint's chat template first (:mod:`raymoe.driver.chat`) and take loss on the
assistant's answers only (``loss_on="assistant"``, the default) or on every token (``"all"``). Tokenizing
runs in parallel and is cached on disk by content hash (:mod:`raymoe.driver.tokenized`).

Packing (``packing=``) makes rows of ``seq_len`` tokens; a row's tail is right-padded with
``attention_mask == 0`` (no loss)::

    "document" (default)   documents keep their ids (``document_ids``): positions restart at each one and
                           attention stays inside it (block-diagonal causal), so a packed document trains as
                           it would alone; its first token is no target of the previous document.
                           Text documents (each + eos) are cut into rows back to back (a long one continues
                           in the next row, as a new document there); conversations are never cut: each is
                           placed whole into the fullest row it fits (best-fit decreasing), rows ordered by
                           their first conversation
    "plain"                the stream cut into rows, attention crossing document boundaries inside a row

    doc A (5) | eos | doc B (9) | eos | doc C (3) | eos        seq_len = 8, text
    [A A A A A e B B] [B B B B B B B e] [C C C e p p p p]     p = pad, mask 0

A conversation longer than ``seq_len`` is an error naming its file and row unless ``overlong`` says
``"truncate"`` (keep its first ``seq_len`` tokens; one with no answer token left is dropped) or ``"drop"``;
either is counted in :attr:`PackedData.report`.
"""

from __future__ import annotations

import bisect
import json
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cache
from pathlib import Path
from typing import Any, Literal

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

from raymoe.driver.batch import document_starts
from raymoe.driver.chat import (
    CHAT_TEMPLATE_FILE,
    TOKENIZER_CONFIG_FILE,
    ChatTemplate,
    read_tokenizer_config,
    special_token_strings,
)
from raymoe.driver.records import Fields, jsonl_records, open_source
from raymoe.driver.tokenized import EncodeOptions, LossOn, TokenizedExamples, tokenize
from raymoe.models.common.loss import IGNORE_INDEX, count_label_tokens

logger = logging.getLogger(__name__)

TOKENIZER_FILE = "tokenizer.json"
# The byte-level tokenizer of the embedded tiny model: ids 0-255 are the bytes themselves.
END_OF_TEXT = "<|endoftext|>"
PAD = "<|pad|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
BYTE_SPECIAL_TOKENS = (END_OF_TEXT, PAD, IM_START, IM_END)  # ids 256, 257, 258, 259
_EOS_NAMES = (END_OF_TEXT, "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>")
Packing = Literal["document", "plain"]
Overlong = Literal["error", "truncate", "drop"]


class TextTokenizer:
    """A ``tokenizers.Tokenizer`` with what data preparation needs besides: ``eos_token_id`` (the document separator;
    None if unknown), the checkpoint's ``chat_template`` (None if it has none) and its ``tokenizer_config.json``
    (kept so that :meth:`save` writes the checkpoint's tokenizer files back as they were)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        eos_token_id: int | None = None,
        *,
        chat_template: ChatTemplate | None = None,
        config: Mapping[str, Any] | None = None,
        template_file: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.eos_token_id = eos_token_id if eos_token_id is not None else _find_eos(tokenizer)
        self.chat_template = chat_template
        self.config = dict(config or {})
        self._template_file = template_file  # the template came from chat_template.jinja: save it there again

    @classmethod
    def byte_level(cls, chat_template: ChatTemplate | None = None) -> TextTokenizer:
        """UTF-8 bytes as ids 0-255, then ``<|endoftext|>`` (256, the eos), ``<|pad|>`` (257) and the chat turn
        markers ``<|im_start|>`` (258) and ``<|im_end|>`` (259)."""
        return cls(_byte_level_tokenizer(), chat_template=chat_template)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], eos_token_id: int | None = None) -> TextTokenizer:
        return cls(Tokenizer.from_file(str(path)), eos_token_id)

    @property
    def vocab_size(self) -> int:
        """Ids this tokenizer can produce (the model's vocab may be larger, e.g. padded for sharding)."""
        return int(self.tokenizer.get_vocab_size(with_added_tokens=True))

    @property
    def special_tokens(self) -> dict[str, str]:
        """The named special tokens (``bos_token``, ``eos_token``, ...) a chat template is rendered with."""
        template = self.chat_template.special_tokens if self.chat_template is not None else {}
        return {**template, **special_token_strings(self.config)}

    def with_chat_template(self, template: ChatTemplate) -> TextTokenizer:
        """This tokenizer with ``template`` instead of the checkpoint's (saved as ``chat_template.jinja``)."""
        return TextTokenizer(
            self.tokenizer, self.eos_token_id, chat_template=template, config=self.config, template_file=True
        )

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; no special tokens are added."""
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int] | Tensor) -> str:
        values = ids.tolist() if isinstance(ids, Tensor) else list(ids)
        return str(self.tokenizer.decode(values, skip_special_tokens=True))

    def save(self, directory: str | os.PathLike[str]) -> Path:
        """Write ``tokenizer.json`` into ``directory`` (next to a checkpoint, so it travels with it), and the
        ``tokenizer_config.json`` and chat template the tokenizer was loaded with; returns the tokenizer.json path."""
        path = Path(directory) / TOKENIZER_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        self.tokenizer.save(str(path))
        config = dict(self.config)
        if self.chat_template is not None:
            config.pop("chat_template", None)
            if not config:
                config = {"tokenizer_class": "PreTrainedTokenizerFast", **self.chat_template.special_tokens}
            if self._template_file:
                (path.parent / CHAT_TEMPLATE_FILE).write_text(self.chat_template.source, encoding="utf-8")
            else:
                config["chat_template"] = self.chat_template.source
        if config:
            (path.parent / TOKENIZER_CONFIG_FILE).write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
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
    """The tokenizer of a checkpoint directory or hub repository: its ``tokenizer.json``, and its chat template
    (``chat_template.jinja`` or ``tokenizer_config.json``'s ``chat_template``) where it has one. From the hub
    only those files are fetched."""
    directory = Path(name_or_path).expanduser()
    if directory.is_dir():
        path = directory / TOKENIZER_FILE
        if not path.is_file():
            raise ValueError(
                f"no {TOKENIZER_FILE} in {directory}: raymoe tokenizes text with the model's tokenizer.json; "
                "add it, or give pre-tokenized data (.npy)"
            )
        return _with_config(path, directory / TOKENIZER_CONFIG_FILE, directory / CHAT_TEMPLATE_FILE, eos_token_id)
    cache = str(cache_dir) if cache_dir is not None else None
    try:
        file = hf_hub_download(str(name_or_path), TOKENIZER_FILE, revision=revision, cache_dir=cache)
    except (EntryNotFoundError, LocalEntryNotFoundError, RepositoryNotFoundError, HFValidationError) as exc:
        raise ValueError(
            f"cannot get {TOKENIZER_FILE} of {str(name_or_path)!r} ({type(exc).__name__}); give pre-tokenized "
            "data (.npy) or a checkpoint directory that has one"
        ) from exc
    optional = {}
    for name in (TOKENIZER_CONFIG_FILE, CHAT_TEMPLATE_FILE):
        try:
            optional[name] = Path(hf_hub_download(str(name_or_path), name, revision=revision, cache_dir=cache))
        except (EntryNotFoundError, LocalEntryNotFoundError):
            optional[name] = Path(os.devnull)  # the checkpoint has none: no template from it
    return _with_config(Path(file), optional[TOKENIZER_CONFIG_FILE], optional[CHAT_TEMPLATE_FILE], eos_token_id)


def _with_config(
    tokenizer_file: Path, config_file: Path, template_file: Path, eos_token_id: int | None
) -> TextTokenizer:
    config = read_tokenizer_config(config_file) if config_file.is_file() else {}
    origin = str(tokenizer_file.parent)
    template: ChatTemplate | None
    if template_file.is_file():
        template = ChatTemplate(
            template_file.read_text(encoding="utf-8"), special_token_strings(config), str(template_file)
        )
        in_file = True
    else:
        template = ChatTemplate.from_tokenizer_config(config, f"the chat template of {origin}")
        in_file = False
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    return TextTokenizer(tokenizer, eos_token_id, chat_template=template, config=config, template_file=in_file)


def load_chat_template(path: str | os.PathLike[str], special_tokens: Mapping[str, str] | None = None) -> ChatTemplate:
    """A chat template given by the user: a ``.jinja`` file, or a ``tokenizer_config.json`` holding one."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise ValueError(f"chat template file {str(path)!r} does not exist")
    if file.suffix == ".json":
        template = ChatTemplate.from_tokenizer_config(read_tokenizer_config(file), str(file))
        if template is None:
            raise ValueError(f"{file} has no chat_template")
        return template
    try:
        source = file.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"chat template {file} is not UTF-8 text ({exc.reason})") from None
    return ChatTemplate(source, dict(special_tokens or {}), str(file))


# --- packed sequences -------------------------------------------------------------------------


@dataclass(frozen=True)
class DataReport:
    """How a dataset became rows: what was read, what was cut or left out, and what the tokenization cost."""

    source: str
    kind: str
    packing: str
    examples: int
    truncated: int = 0
    dropped: int = 0
    tokens: int = 0
    label_tokens: int = 0
    rows: int = 0
    seq_len: int = 0
    from_cache: bool = False
    cache: Path | None = None
    tokenize_s: float = 0.0

    def summary(self) -> str:
        kinds = {"chat": "conversations", "text": "documents"}
        parts = [f"{self.examples} {kinds.get(self.kind, 'examples')} -> {self.rows} rows of {self.seq_len} tokens"]
        parts.append(f"{self.packing} packing, {self.tokens / max(1, self.rows * self.seq_len):.0%} filled")
        parts.append(f"{self.label_tokens} label tokens")
        if self.truncated:
            parts.append(f"{self.truncated} truncated to seq_len")
        if self.dropped:
            parts.append(f"{self.dropped} longer than seq_len dropped")
        if self.cache is not None:
            parts.append(
                f"tokenized {'from the cache' if self.from_cache else 'and cached'} in {self.tokenize_s:.1f} s"
            )
        return "; ".join(parts)


@dataclass(frozen=True)
class PackedData:
    """Rows of token ids ``input_ids [N, S]`` and ``attention_mask [N, S]`` (0 = right padding, no loss); for
    chat data ``labels [N, S]`` (-100: no loss; None: every real token is a label), for document packing
    ``document_ids [N, S]`` (a run of equal ids is one document, see the module docstring)."""

    input_ids: Tensor
    attention_mask: Tensor
    labels: Tensor | None = None
    document_ids: Tensor | None = None
    report: DataReport | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.input_ids.dim() != 2 or self.input_ids.shape != self.attention_mask.shape:
            raise ValueError(
                f"PackedData: input_ids {tuple(self.input_ids.shape)} and attention_mask "
                f"{tuple(self.attention_mask.shape)} must both be [num_sequences, seq_len]"
            )
        for name in ("labels", "document_ids"):
            value = getattr(self, name)
            if value is not None and value.shape != self.input_ids.shape:
                raise ValueError(f"PackedData: {name} {tuple(value.shape)} must be shaped like input_ids")

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

    @property
    def num_label_tokens(self) -> int:
        """Targets the loss averages over, counted as ``train_step`` counts them (``num_tokens`` of its metrics)."""
        return count_label_tokens(self.targets())

    def targets(self) -> Tensor:
        """The labels ``train_step`` trains on: ``labels`` (or the ids), -100 on padding and document starts."""
        targets = (self.labels if self.labels is not None else self.input_ids).masked_fill(
            self.attention_mask == 0, IGNORE_INDEX
        )
        if self.document_ids is not None:
            targets = targets.masked_fill(document_starts(self.document_ids), IGNORE_INDEX)
        return targets

    def rows(self, index: Tensor | slice) -> PackedData:
        def pick(tensor: Tensor | None) -> Tensor | None:
            return tensor[index] if tensor is not None else None

        return PackedData(self.input_ids[index], self.attention_mask[index], pick(self.labels), pick(self.document_ids))

    def with_blank_rows(self, count: int) -> PackedData:
        """These rows and ``count`` all-padding rows after them (mask 0: they add no token)."""
        if count <= 0:
            return self
        blank = torch.zeros((count, self.seq_len), dtype=torch.int64)

        def extend(tensor: Tensor | None, fill: int) -> Tensor | None:
            return None if tensor is None else torch.cat([tensor, blank.to(tensor.dtype).fill_(fill)])

        return PackedData(
            torch.cat([self.input_ids, blank]),
            torch.cat([self.attention_mask, blank]),
            extend(self.labels, IGNORE_INDEX),
            extend(self.document_ids, -1),
        )

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


def _check_seq_len(seq_len: object) -> int:
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 2:
        raise ValueError(f"seq_len={seq_len!r} must be an int >= 2 (a row needs an input and a next token)")
    return seq_len


def pack_documents(
    documents: Iterable[Sequence[int]], seq_len: int, eos_token_id: int | None, pad_token_id: int = 0
) -> PackedData:
    """Token documents as one stream (each followed by ``eos_token_id``), cut into ``[N, seq_len]`` rows
    (plain packing: attention crosses the documents of a row).

    The last row is right-padded with ``pad_token_id`` (any valid id: padding has mask 0, takes no
    loss and, being on the right, is attended by no real token).
    """
    _check_seq_len(seq_len)
    separator = [eos_token_id] if eos_token_id is not None else []
    stream = [token for doc in documents if len(doc) for token in (*doc, *separator)]
    if len(stream) < 2:
        raise ValueError("the dataset is empty: its documents hold fewer than 2 tokens")
    ids, mask, _, _ = _cut_stream(np.asarray(stream, dtype=np.int64), None, None, seq_len, pad_token_id)
    return PackedData(ids, mask)


def _cut_stream(
    ids: np.ndarray, labels: np.ndarray | None, documents: np.ndarray | None, seq_len: int, pad_token_id: int
) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
    """A token stream cut into rows of ``seq_len``, the last one right-padded (dropped if it holds one token only,
    which has no next-token target)."""
    total = len(ids)
    num_rows = -(-total // seq_len)
    size = num_rows * seq_len

    def filled(values: np.ndarray, pad: int) -> Tensor:
        out = np.full(size, pad, dtype=np.int64)
        out[:total] = values
        return torch.from_numpy(out).view(num_rows, seq_len)

    mask = filled(np.ones(total, dtype=np.int64), 0)
    rows = num_rows - 1 if total % seq_len == 1 else num_rows
    return (
        filled(ids, pad_token_id)[:rows],
        mask[:rows],
        filled(labels, IGNORE_INDEX)[:rows] if labels is not None else None,
        filled(documents, -1)[:rows] if documents is not None else None,
    )


def pack_examples(
    examples: TokenizedExamples,
    seq_len: int,
    *,
    packing: Packing = "document",
    overlong: Overlong = "error",
    pad_token_id: int = 0,
) -> PackedData:
    """Tokenized examples as rows of ``seq_len`` (see the module docstring for ``packing`` and ``overlong``)."""
    _check_seq_len(seq_len)
    if packing not in ("document", "plain"):
        raise ValueError(f"packing={packing!r}: choose 'document' or 'plain'")
    if overlong not in ("error", "truncate", "drop"):
        raise ValueError(f"overlong={overlong!r}: choose 'error', 'truncate' or 'drop'")
    lengths = examples.lengths
    starts = examples.offsets[:-1]
    truncated = dropped = 0
    keep = np.ones(len(lengths), dtype=bool)
    if examples.kind == "chat":
        long = np.flatnonzero(lengths > seq_len)
        if len(long) and overlong == "error":
            first = int(long[0])
            raise ValueError(
                f"{examples.where(first)} is {int(lengths[first])} tokens long, more than seq_len={seq_len} "
                f"({len(long)} of {len(lengths)} conversations are); raise --seq-len, or pass --overlong truncate "
                "(keep the first seq_len tokens) or --overlong drop"
            )
        if overlong == "drop":
            keep[long] = False
            dropped = len(long)
        elif overlong == "truncate":
            assert examples.labels is not None
            answered = np.array([examples.labels[starts[i] : starts[i] + seq_len].any() for i in long], dtype=bool)
            keep[long[~answered]] = False  # nothing of the answer fits: nothing to train on
            dropped = int((~answered).sum())
            truncated = int(answered.sum())
        lengths = np.minimum(lengths, seq_len)
    starts, lengths = starts[keep], lengths[keep]
    if len(lengths) == 0 or int(lengths.sum()) < 2:
        raise ValueError(f"{examples.source} is empty: after dropping what exceeds seq_len={seq_len}, nothing is left")
    # Every kept token's index in the examples' arrays, in order.
    total = int(lengths.sum())
    ends = np.cumsum(lengths)
    index = np.arange(total, dtype=np.int64) + np.repeat(starts - (ends - lengths), lengths)
    ids = examples.ids[index].astype(np.int64)
    labels = np.where(examples.labels[index], ids, IGNORE_INDEX) if examples.labels is not None else None
    documents = np.repeat(np.arange(len(lengths), dtype=np.int64), lengths)
    rows: tuple[Tensor, Tensor, Tensor | None, Tensor | None]
    if examples.kind == "chat" and packing == "document":
        rows = _pack_whole(ids, labels, documents, lengths, seq_len, pad_token_id)
    else:
        rows = _cut_stream(ids, labels, documents if packing == "document" else None, seq_len, pad_token_id)
    data = PackedData(*rows)
    report = DataReport(
        source=examples.source,
        kind=examples.kind,
        packing=packing,
        examples=len(lengths),
        truncated=truncated,
        dropped=dropped,
        tokens=data.num_tokens,
        label_tokens=data.num_label_tokens,
        rows=data.num_sequences,
        seq_len=seq_len,
        from_cache=examples.from_cache,
        cache=examples.cache,
        tokenize_s=examples.seconds,
    )
    return replace(data, report=report)


def _pack_whole(
    ids: np.ndarray,
    labels: np.ndarray | None,
    documents: np.ndarray,
    lengths: np.ndarray,
    seq_len: int,
    pad_token_id: int,
) -> tuple[Tensor, Tensor, Tensor | None, Tensor]:
    """Whole examples (each ``<= seq_len``) into rows, best-fit decreasing; rows ordered by their first example."""
    row_of, column_of, num_rows = _best_fit_decreasing(lengths, seq_len)
    first_example = np.full(num_rows, len(lengths), dtype=np.int64)
    np.minimum.at(first_example, row_of, np.arange(len(lengths)))
    order = np.argsort(first_example, kind="stable")
    rank = np.empty(num_rows, dtype=np.int64)
    rank[order] = np.arange(num_rows)
    ends = np.cumsum(lengths)
    within = np.arange(int(ends[-1]), dtype=np.int64) - np.repeat(ends - lengths, lengths)
    target = np.repeat(rank[row_of] * seq_len + column_of, lengths) + within
    size = num_rows * seq_len

    def placed(values: np.ndarray, pad: int) -> Tensor:
        out = np.full(size, pad, dtype=np.int64)
        out[target] = values
        return torch.from_numpy(out).view(num_rows, seq_len)

    return (
        placed(ids, pad_token_id),
        placed(np.ones(len(ids), dtype=np.int64), 0),
        placed(labels, IGNORE_INDEX) if labels is not None else None,
        placed(documents, -1),
    )


def _best_fit_decreasing(lengths: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray, int]:
    """``(row, column, rows)``: each length placed into the row with the least room that still fits it, longest
    first. Rows with room ``r`` are kept in a bucket per ``r`` and the distinct rooms in a sorted list, so a
    placement costs a bisection (not a scan of the rows)."""
    row_of = np.empty(len(lengths), dtype=np.int64)
    column_of = np.empty(len(lengths), dtype=np.int64)
    rooms: list[int] = []  # sorted distinct rooms with at least one row
    rows_with: dict[int, list[int]] = {}
    used: list[int] = []  # tokens placed in each row
    for example in np.argsort(-lengths, kind="stable").tolist():
        length = int(lengths[example])
        at = bisect.bisect_left(rooms, length)
        if at < len(rooms):
            room = rooms[at]
            row = rows_with[room].pop()
            if not rows_with[room]:
                del rows_with[room]
                rooms.pop(at)
        else:
            row, room = len(used), capacity
            used.append(0)
        row_of[example], column_of[example] = row, used[row]
        used[row] += length
        left = room - length
        if left > 0:
            if left not in rows_with:
                bisect.insort(rooms, left)
                rows_with[left] = []
            rows_with[left].append(row)
    return row_of, column_of, len(used)


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
    for number, record in jsonl_records(file, f"dataset {file}"):
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
    messages_field: str = "messages",
    prompt_field: str = "prompt",
    completion_field: str = "completion",
    packing: Packing = "document",
    loss_on: LossOn = "assistant",
    overlong: Overlong = "error",
    chat_template: ChatTemplate | str | os.PathLike[str] | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
    split: str = "train",
    dataset_config: str | None = None,
    cache_dir: str | os.PathLike[str] | Literal[False] | None = None,
    num_proc: int | None = None,
    progress: bool = False,
) -> PackedData:
    """Read, tokenize and pack ``path`` (see the module docstring for the formats, packing and ``overlong``).

    ``chat_template`` replaces the tokenizer's (a :class:`ChatTemplate`, or the path of a ``.jinja`` file or of a
    ``tokenizer_config.json``); ``template_kwargs`` are the template's extra variables (``enable_thinking``,
    ``reasoning_effort``...). ``split`` / ``dataset_config`` choose a ``datasets`` split and configuration.
    ``cache_dir``: where tokenized examples are cached (default ``$RAYMOE_CACHE_DIR`` or
    ``~/.cache/raymoe/tokenized``; False: no cache). ``num_proc``: tokenizing processes (default: by size).
    ``progress`` shows a progress bar while tokenizing. The result's ``report`` says what happened.
    """
    _check_seq_len(seq_len)
    if packing not in ("document", "plain"):
        raise ValueError(f"packing={packing!r}: choose 'document' or 'plain'")
    file = Path(path).expanduser()
    if file.suffix == ".npy":
        return _load_npy(_existing_file(file), seq_len, tokenizer)
    source = open_source(path, split=split, config_name=dataset_config)
    if tokenizer is None:
        raise ValueError(f"{source.name} is text and needs a tokenizer; give one, or pre-tokenized data (.npy)")
    template = tokenizer.chat_template
    if isinstance(chat_template, ChatTemplate):
        template = chat_template
    elif chat_template is not None:
        template = load_chat_template(chat_template, tokenizer.special_tokens)
    fields = Fields(text=text_field, messages=messages_field, prompt=prompt_field, completion=completion_field)
    options = EncodeOptions(fields, loss_on, dict(template_kwargs or {}))
    examples = tokenize(
        source,
        tokenizer.tokenizer,
        tokenizer.eos_token_id,
        template,
        options,
        cache_dir=cache_dir,
        num_proc=num_proc,
        progress=progress,
    )
    data = pack_examples(examples, seq_len, packing=packing, overlong=overlong)
    if data.num_sequences == 0 or data.num_tokens < 2:
        raise ValueError(f"{source.name} is empty: it holds no tokens to train on")
    if data.report is not None:
        logger.info("%s: %s", source.name, data.report.summary())
    return data


def _load_npy(file: Path, seq_len: int, tokenizer: TextTokenizer | None) -> PackedData:
    array = load_token_array(file)
    if array.size < 2:
        raise ValueError(f"dataset {file} is empty: it holds {array.size} tokens")
    if array.ndim == 2:
        data = PackedData.from_rows(array)
    else:
        eos = tokenizer.eos_token_id if tokenizer is not None else None
        data = pack_documents([array.tolist()], seq_len, eos)
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
