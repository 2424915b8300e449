"""One batch of records into token ids and loss masks: text documents (+ eos), or conversations rendered with
the chat template whose assistant answers (and the special token closing each) take the loss.

    text   the document's ids + eos                      labels: None (every real token is a label)
    chat   render(messages) -> ids, the tokens whose      labels: bool per token
           characters overlap an answer span

An :class:`ExampleEncoder` is picklable: worker processes rebuild the tokenizer from its JSON
(:mod:`raymoe.driver.tokenized` runs the batches, in parallel where it pays).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from tokenizers import Tokenizer

from raymoe.driver.chat import ChatTemplate, check_messages
from raymoe.driver.records import Fields, RecordKind, describe_record, record_kind

LossOn = Literal["assistant", "all"]


@dataclass(frozen=True)
class EncodeOptions:
    """What turns records into examples besides the tokenizer and template (all part of the cache key)."""

    fields: Fields = field(default_factory=Fields)
    loss_on: LossOn = "assistant"
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.loss_on not in ("assistant", "all"):
            raise ValueError(f"loss_on={self.loss_on!r}: choose 'assistant' or 'all'")
        try:
            json.dumps(dict(self.template_kwargs))
        except TypeError as exc:
            raise ValueError(f"template_kwargs must be JSON values (they are part of the cache key): {exc}") from None


@dataclass
class Chunk:
    """A batch's examples: token ids, loss masks (chat) or None, and their source rows."""

    ids: list[np.ndarray]
    labels: list[np.ndarray] | None
    rows: list[int]


class ExampleEncoder:
    """Encodes batches of ``(row number, record)``; picklable (workers rebuild the tokenizer from its JSON)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        eos_token_id: int | None,
        template: ChatTemplate | None,
        kind: RecordKind,
        options: EncodeOptions,
        source: str,
        unit: str = "row",
    ) -> None:
        self.tokenizer_json = tokenizer.to_str()
        self.eos_token_id = eos_token_id
        self.template = template
        self.kind = kind
        self.options = options
        self.source = source
        self.unit = unit
        self._setup()

    def _setup(self) -> None:
        tokenizer = Tokenizer.from_str(self.tokenizer_json)
        # Without added special tokens a post-processor changes no id, only (for ByteLevel) trims the offsets
        # of tokens that start with a space; untrimmed offsets say exactly which characters each token covers.
        tokenizer.post_processor = None
        self._tokenizer = tokenizer
        self._special_ids = np.array(
            sorted(i for i, token in tokenizer.get_added_tokens_decoder().items() if token.special), dtype=np.int64
        )

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k not in ("_tokenizer", "_special_ids")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._setup()

    def where(self, row: int) -> str:
        return f"{self.source} {self.unit} {row}"

    def encode(self, batch: list[tuple[int, Any]]) -> Chunk:
        for row, record in batch:
            kind = record_kind(record, self.options.fields)
            if kind != self.kind:
                raise ValueError(self._wrong_kind(row, record))
        if self.kind == "text":
            return self._encode_text(batch)
        return self._encode_chat(batch)

    def _wrong_kind(self, row: int, record: object) -> str:
        fields = self.options.fields
        want = (
            f"a JSON string or an object with a string field {fields.text!r}"
            if self.kind == "text"
            else f"an object with {fields.messages!r}, or {fields.prompt!r} and {fields.completion!r}"
        )
        return f"{self.where(row)} must be {want} (like the first record), got {describe_record(record)}"

    def _encode_text(self, batch: list[tuple[int, Any]]) -> Chunk:
        texts = [record if isinstance(record, str) else record[self.options.fields.text] for _, record in batch]
        eos = [self.eos_token_id] if self.eos_token_id is not None else []
        chunk = Chunk([], None, [])
        for (row, _), encoding in zip(
            batch, self._tokenizer.encode_batch(texts, add_special_tokens=False), strict=True
        ):
            if encoding.ids:  # an empty document adds nothing, not even a separator
                chunk.ids.append(np.asarray([*encoding.ids, *eos], dtype=np.int32))
                chunk.rows.append(row)
        return chunk

    def _encode_chat(self, batch: list[tuple[int, Any]]) -> Chunk:
        if self.template is None:
            raise ValueError(
                f"{self.source} holds conversations, but the checkpoint has no chat template (no chat_template in "
                "its tokenizer_config.json and no chat_template.jinja): give one with --chat-template FILE "
                "(load_dataset(..., chat_template=...))"
            )
        texts, spans_of = [], []
        kwargs = dict(self.options.template_kwargs)
        for row, record in batch:
            messages = self._conversation(row, record)
            try:
                if self.options.loss_on == "assistant":
                    text, spans = self.template.answer_spans(messages, **kwargs)
                else:
                    text, spans = self.template.render(messages, **kwargs), []
            except ValueError as exc:
                raise ValueError(f"{self.where(row)}: {exc}") from None
            texts.append(text)
            spans_of.append(spans)
        chunk = Chunk([], [], [])
        assert chunk.labels is not None
        for (row, _), encoding, spans in zip(
            batch, self._tokenizer.encode_batch(texts, add_special_tokens=False), spans_of, strict=True
        ):
            ids = np.asarray(encoding.ids, dtype=np.int32)
            if self.options.loss_on == "all":
                labels = np.ones(len(ids), dtype=bool)
            else:
                labels = self._answer_labels(ids, np.asarray(encoding.offsets, dtype=np.int64).reshape(-1, 2), spans)
                if not labels.any():
                    raise ValueError(f"{self.where(row)}: no token of the assistant answers survives tokenization")
            chunk.ids.append(ids)
            chunk.labels.append(labels)
            chunk.rows.append(row)
        return chunk

    def _conversation(self, row: int, record: dict[str, Any]) -> list[dict[str, Any]]:
        fields, where = self.options.fields, self.where(row)
        if record.get(fields.messages) is not None:
            return check_messages(record[fields.messages], where)
        prompt, completion = record[fields.prompt], record[fields.completion]
        if isinstance(prompt, str) and isinstance(completion, str):
            messages: object = [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
        elif isinstance(prompt, list) and isinstance(completion, list):
            if not all(isinstance(m, dict) and m.get("role") == "assistant" for m in completion) or not completion:
                raise ValueError(f"{where}: {fields.completion!r} must be a list of assistant messages")
            messages = [*prompt, *completion]
        else:
            raise ValueError(
                f"{where}: {fields.prompt!r} and {fields.completion!r} must both be strings or both lists of messages, "
                f"got {type(prompt).__name__} and {type(completion).__name__}"
            )
        return check_messages(messages, where)

    def _answer_labels(self, ids: np.ndarray, offsets: np.ndarray, spans: list[tuple[int, int]]) -> np.ndarray:
        """Tokens overlapping an answer's characters, and the special token right after each answer."""
        starts, ends = offsets[:, 0], offsets[:, 1]
        labels = np.zeros(len(ids), dtype=bool)
        for start, end in spans:
            labels |= ((starts < end) & (ends > start)) | ((starts == ends) & (starts >= start) & (starts < end))
            after = int(np.searchsorted(starts, end, side="left"))  # the first token starting at or after the end
            if after < len(ids) and starts[after] == end and np.isin(ids[after], self._special_ids):
                labels[after] = True
        return labels
