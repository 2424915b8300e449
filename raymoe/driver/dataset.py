"""Training data files on the driver: documents, conversations and token arrays in, packed rows out.

    .jsonl / .parquet   one record per line / row: a document (``text``, or a bare JSON string) or a
                        conversation (``messages``, or ``prompt`` + ``completion``); field names are options
    directory, hub id   a Hugging Face ``datasets`` split of such records (optional ``datasets`` extra)
    .npy                pre-tokenized: 1-D token stream (packed here) or 2-D [N, S] already packed
    other               plain UTF-8 text; the whole file is one document

Text is tokenized with the model's tokenizer (:mod:`raymoe.driver.tokenizer`); conversations are rendered
with the checkpoint's chat template first (:mod:`raymoe.driver.chat`) and take loss on the assistant's answers
only (``loss_on="assistant"``, the default) or on every token (``"all"``). Tokenizing runs in parallel and is
cached on disk by content hash (:mod:`raymoe.driver.tokenized`); packing is :mod:`raymoe.driver.packing`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import numpy as np

from raymoe.driver.chat import ChatTemplate
from raymoe.driver.example_encoder import EncodeOptions, LossOn
from raymoe.driver.packing import Overlong, PackedData, Packing, check_seq_len, pack_examples, pack_token_stream
from raymoe.driver.records import Fields, open_source
from raymoe.driver.row_packing import check_pack_options, check_pack_window
from raymoe.driver.tokenized import tokenize
from raymoe.driver.tokenizer import TextTokenizer, load_chat_template

logger = logging.getLogger(__name__)


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
    pack_window: int | None = None,
) -> PackedData:
    """Read, tokenize and pack ``path`` (see the module docstring for the formats, packing and ``overlong``).

    ``chat_template`` replaces the tokenizer's (a :class:`ChatTemplate`, or the path of a ``.jinja`` file or of a
    ``tokenizer_config.json``); ``template_kwargs`` are the template's extra variables (``enable_thinking``,
    ``reasoning_effort``...). ``split`` / ``dataset_config`` choose a ``datasets`` split and configuration.
    ``cache_dir``: where tokenized examples are cached (default ``$RAYMOE_CACHE_DIR`` or
    ``~/.cache/raymoe/tokenized``; False: no cache). ``num_proc``: tokenizing processes (default: by size).
    ``progress`` shows a progress bar while tokenizing. ``pack_window``: examples packed together (None, the default:
    the whole dataset; see :mod:`raymoe.driver.packing`). The result's ``report`` says what happened.
    """
    check_seq_len(seq_len)
    check_pack_options(packing, overlong)
    check_pack_window(pack_window)
    file = Path(path).expanduser()
    if file.suffix == ".npy":
        return _load_npy(_existing_file(file), seq_len, tokenizer)
    source = open_source(path, split=split, config_name=dataset_config)
    if tokenizer is None:
        raise ValueError(f"{source.name} is text and needs a tokenizer; give one, or pre-tokenized data (.npy)")
    fields = Fields(text=text_field, messages=messages_field, prompt=prompt_field, completion=completion_field)
    template, options = encoding_of(tokenizer, fields, loss_on, chat_template, template_kwargs)
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
    data = pack_examples(examples, seq_len, packing=packing, overlong=overlong, pack_window=pack_window)
    if data.num_sequences == 0 or data.num_tokens < 2:
        raise ValueError(f"{source.name} is empty: it holds no tokens to train on")
    if data.report is not None:
        logger.info("%s: %s", source.name, data.report.summary())
    return data


def encoding_of(
    tokenizer: TextTokenizer,
    fields: Fields,
    loss_on: LossOn,
    chat_template: ChatTemplate | str | os.PathLike[str] | None,
    template_kwargs: Mapping[str, Any] | None,
) -> tuple[ChatTemplate | None, EncodeOptions]:
    """The chat template conversations are rendered with (``chat_template``, else the tokenizer's) and the encoding
    options: what both engines give the :class:`~raymoe.driver.example_encoder.ExampleEncoder`."""
    template = tokenizer.chat_template
    if isinstance(chat_template, ChatTemplate):
        template = chat_template
    elif chat_template is not None:
        template = load_chat_template(chat_template, tokenizer.special_tokens)
    return template, EncodeOptions(fields, loss_on, dict(template_kwargs or {}))


def _load_npy(file: Path, seq_len: int, tokenizer: TextTokenizer | None) -> PackedData:
    array = load_token_array(file)
    if array.size < 2:
        raise ValueError(f"dataset {file} is empty: it holds {array.size} tokens")
    if array.ndim == 2:
        data = PackedData.from_rows(array)
    else:
        eos = tokenizer.eos_token_id if tokenizer is not None else None
        data = pack_token_stream([array.tolist()], seq_len, eos)
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
