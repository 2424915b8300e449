"""The model's tokenizer on the driver: its ``tokenizer.json`` (the ``tokenizers`` package), its eos id, and the chat
template and ``tokenizer_config.json`` it came with, written back beside a saved checkpoint as they were.

    load_tokenizer(dir or hub id)     tokenizer.json (+ chat_template.jinja / tokenizer_config.json) of a checkpoint
    TextTokenizer.byte_level()        UTF-8 bytes as ids 0-255, then the embedded model's special tokens
    load_chat_template(path)          a user's template: a .jinja file or a tokenizer_config.json holding one
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from functools import cache
from pathlib import Path
from typing import Any

from huggingface_hub import hf_hub_download
from huggingface_hub.errors import (
    EntryNotFoundError,
    HFValidationError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
)
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from torch import Tensor

from raymoe.checkpoint.download import fetch_checkpoint
from raymoe.checkpoint.hub import storage_source
from raymoe.driver.chat import (
    CHAT_TEMPLATE_FILE,
    TOKENIZER_CONFIG_FILE,
    ChatTemplate,
    read_tokenizer_config,
    special_token_strings,
)

TOKENIZER_FILE = "tokenizer.json"
# The byte-level tokenizer of the embedded tiny model: ids 0-255 are the bytes themselves.
END_OF_TEXT = "<|endoftext|>"
PAD = "<|pad|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
BYTE_SPECIAL_TOKENS = (END_OF_TEXT, PAD, IM_START, IM_END)  # ids 256, 257, 258, 259
_EOS_NAMES = (END_OF_TEXT, "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>")


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
    only those files are fetched, as from a storage URL (``s3://bucket/model``: into this node's cache)."""
    url = storage_source(name_or_path)
    files = (TOKENIZER_FILE, TOKENIZER_CONFIG_FILE, CHAT_TEMPLATE_FILE)
    directory = fetch_checkpoint(url, files, cache_dir) if url is not None else Path(name_or_path).expanduser()
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
