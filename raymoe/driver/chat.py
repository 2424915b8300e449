"""Chat templates on the driver: a checkpoint's Jinja template rendered as transformers renders it, and where the
assistant's answers lie in the rendered text (what assistant-only loss trains on).

The template comes from the checkpoint (``chat_template.jinja``, else ``tokenizer_config.json``'s
``chat_template``: a string, or a list of named templates of which ``default`` is taken) or from the
user. Rendering follows transformers 5 ``apply_chat_template(messages, tokenize=False)``: a sandboxed
Jinja environment with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, its
``tojson``, ``raise_exception``, ``strftime_now``, ``dict`` and ``namespace``; messages with their
``None`` values dropped and the reasoning aliased (``reasoning_content`` / ``thinking`` / ``reasoning``
all filled from whichever is given); the tokenizer config's named special tokens (``bos_token``, ...) as
variables. The rendered text is then tokenized whole, without added special tokens, as transformers does.

Which characters are the answers (:meth:`ChatTemplate.answer_spans`)::

    template with {% generation %} blocks   those blocks (transformers' assistant mask)
    any other template                      each assistant message's content, located by rendering the
                                            conversation once more with the contents replaced by markers;
                                            with a reasoning field rendered before it (Qwen3
                                            ``reasoning_content``, gpt-oss ``thinking``), from the reasoning's
                                            first character on, so the text the model writes between the two
                                            (``</think>``, gpt-oss's channel switch) is trained as well

The tokenizer then adds the special token that directly follows an answer (``<|im_end|>``,
``<|return|>``, DeepSeek's end of sentence): the model must learn to stop.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2

from raymoe.driver.chat_jinja import compile_template, generation_tracker, uses_generation_tags

CHAT_TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
# The named special tokens transformers passes to every template (its SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
ROLES = ("system", "developer", "user", "assistant")
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# Markers that stand in for an answer while locating it: private-use characters, no whitespace, nothing a
# template splits on, so string methods (strip, split('</think>')) leave them whole.
_MARK = re.compile("\ue000(\\d+)([ac])\ue001")


@dataclass(frozen=True)
class ChatTemplate:
    """A Jinja chat template, the special-token variables it is rendered with, and where it came from."""

    source: str
    special_tokens: Mapping[str, str] = field(default_factory=dict)
    origin: str = "the chat template"

    @classmethod
    def from_tokenizer_config(
        cls, config: Mapping[str, Any], origin: str, template: str | None = None
    ) -> ChatTemplate | None:
        """The template of a parsed ``tokenizer_config.json`` (or ``template``, read from ``chat_template.jinja``);
        None if it has none."""
        source = template if template is not None else _template_of(config.get("chat_template"), origin)
        if source is None:
            return None
        return cls(source, special_token_strings(config), origin)

    @classmethod
    def from_directory(cls, directory: str | Path) -> ChatTemplate | None:
        """The template of a checkpoint directory (``chat_template.jinja`` first, as transformers reads it)."""
        root = Path(directory)
        config = read_tokenizer_config(root / TOKENIZER_CONFIG_FILE)
        jinja_file = root / CHAT_TEMPLATE_FILE
        if jinja_file.is_file():
            return cls.from_tokenizer_config(config, str(jinja_file), jinja_file.read_text(encoding="utf-8"))
        return cls.from_tokenizer_config(config, str(root / TOKENIZER_CONFIG_FILE))

    def tokenizer_config(self) -> dict[str, Any]:
        """What ``tokenizer_config.json`` holds to carry this template (transformers reads it back)."""
        return {"chat_template": self.source, **self.special_tokens}

    # --- rendering --------------------------------------------------------------------------------

    def render(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = False, **kwargs: Any
    ) -> str:
        """The conversation as text, exactly as transformers' ``apply_chat_template(..., tokenize=False)``."""
        return self._render(_as_template_messages(messages), add_generation_prompt, kwargs)

    def answer_spans(self, messages: Sequence[Mapping[str, Any]], **kwargs: Any) -> tuple[str, list[tuple[int, int]]]:
        """``(text, spans)``: the rendered conversation and the ``[start, end)`` character ranges of its answers
        (see the module docstring). A ``ValueError`` when an answer cannot be located in the text."""
        chat = _as_template_messages(messages)
        if uses_generation_tags(self.source):
            return self._render_tracked(chat, kwargs)
        text = self._render(chat, False, kwargs)
        marked_chat, answers = _with_markers(chat)
        marked = self._render(marked_chat, False, kwargs)
        return text, _locate_answers(text, marked, answers, self.origin)

    def _render(self, chat: list[dict[str, Any]], add_generation_prompt: bool, kwargs: Mapping[str, Any]) -> str:
        template = compile_template(self.source)
        try:
            return str(
                template.render(
                    messages=chat,
                    tools=None,
                    documents=None,
                    add_generation_prompt=add_generation_prompt,
                    **{**self.special_tokens, **kwargs},
                )
            )
        except jinja2.TemplateError as exc:
            raise ValueError(f"{self.origin} refused the conversation: {exc}") from None

    def _render_tracked(
        self, chat: list[dict[str, Any]], kwargs: Mapping[str, Any]
    ) -> tuple[str, list[tuple[int, int]]]:
        template = compile_template(self.source)
        blocks: list[str] = []
        spans: list[tuple[int, int]] = []
        tracker = generation_tracker(template.environment)
        try:
            with tracker.active(blocks, spans):
                for block in template.generate(
                    messages=chat,
                    tools=None,
                    documents=None,
                    add_generation_prompt=False,
                    **{**self.special_tokens, **kwargs},
                ):
                    blocks.append(block)
        except jinja2.TemplateError as exc:
            raise ValueError(f"{self.origin} refused the conversation: {exc}") from None
        return "".join(blocks), spans


# --- reading a checkpoint's tokenizer config --------------------------------------------------------


def read_tokenizer_config(path: Path) -> dict[str, Any]:
    """A ``tokenizer_config.json`` as a dict ({} when absent); a ``ValueError`` naming the file when unreadable."""
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(config).__name__}")
    return config


def special_token_strings(config: Mapping[str, Any]) -> dict[str, str]:
    """The named special tokens of a tokenizer config as strings (a saved ``AddedToken`` is a dict with
    ``content``); absent or null ones are left out, as transformers leaves them out of the template's variables."""
    tokens = {}
    for name in SPECIAL_TOKEN_NAMES:
        value = config.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            tokens[name] = value
    return tokens


def _template_of(value: object, origin: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):  # named templates: [{"name": "default", "template": "..."}, ...]
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        default = named.get("default")
        if isinstance(default, str):
            return default
        raise ValueError(f"{origin}: chat_template lists templates {sorted(map(str, named))} but none named 'default'")
    raise ValueError(f"{origin}: chat_template must be a string or a list of named templates")


# --- messages -------------------------------------------------------------------------------------


def check_messages(messages: object, where: str) -> list[dict[str, Any]]:
    """``messages`` as a list of ``{"role", "content"}`` dicts, or a ``ValueError`` naming ``where`` (file and row)
    and what is wrong: not a list, an unknown role, content that is not text, no assistant turn."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: messages must be a non-empty list of {{'role', 'content'}} objects")
    checked = []
    for index, message in enumerate(messages):
        at = f"{where} message {index}"
        if not isinstance(message, dict):
            raise ValueError(f"{at} must be an object with 'role' and 'content', got {type(message).__name__}")
        role = message.get("role")
        if role == "tool" or message.get("tool_calls"):
            raise ValueError(
                f"{at}: tool calls and tool results are not supported yet (loss masking of rendered tool calls); "
                "leave those conversations out"
            )
        if role not in ROLES:
            raise ValueError(f"{at} has an unknown role {role!r}; known roles: {', '.join(ROLES)}")
        content = message.get("content")
        if not isinstance(content, str):
            kind = "a list of content parts" if isinstance(content, list) else type(content).__name__
            raise ValueError(f"{at} ({role}) must have text content (a string), got {kind}")
        for name in REASONING_FIELDS:
            if message.get(name) is not None and not isinstance(message[name], str):
                raise ValueError(f"{at} ({role}): {name} must be a string, got {type(message[name]).__name__}")
        checked.append(message)
    if not any(m["role"] == "assistant" for m in checked):
        raise ValueError(f"{where}: the conversation has no assistant turn, so nothing to train on")
    return checked


def _as_template_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """transformers' preparation: ``None`` values dropped, the reasoning aliased under every name templates read."""
    chat = []
    for message in messages:
        plain = {key: value for key, value in message.items() if value is not None}
        reasoning = next((plain[key] for key in REASONING_FIELDS if plain.get(key) is not None), None)
        if reasoning is not None:
            plain = {"thinking": reasoning, **plain, "reasoning_content": reasoning}
        chat.append(plain)
    return chat


# --- locating answers -----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Answer:
    message: int
    content: str
    reasoning: str | None


def _with_markers(chat: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[_Answer]]:
    """The conversation with each assistant content (and reasoning) replaced by a unique marker."""
    marked, answers = [], []
    for index, message in enumerate(chat):
        if message.get("role") != "assistant":
            marked.append(message)
            continue
        reasoning = message.get("reasoning_content")
        answers.append(_Answer(index, message["content"], reasoning))
        copy = {**message, "content": f"\ue000{index}a\ue001"}
        if reasoning is not None:
            for name in REASONING_FIELDS:
                if name in copy:
                    copy[name] = f"\ue000{index}c\ue001"
        marked.append(copy)
    return marked, answers


def _locate_answers(text: str, marked: str, answers: list[_Answer], origin: str) -> list[tuple[int, int]]:
    """Walk the marked rendering alongside the real one: the literal text between markers must match, and each
    marker stands for its value as the template wrote it (as is, or with surrounding whitespace stripped)."""
    pieces = _MARK.split(marked)  # [literal, index, kind, literal, index, kind, ..., literal]
    by_message = {answer.message: answer for answer in answers}
    found: dict[tuple[int, str], list[tuple[int, int]]] = {}
    position = 0

    def fail(reason: str) -> ValueError:
        return ValueError(
            f"cannot locate the assistant answers in the text {origin} renders ({reason}); "
            "use --loss-on all, or a template that renders each answer's content as given"
        )

    if not text.startswith(pieces[0]):
        raise fail("the rendering is not deterministic")
    position = len(pieces[0])
    for i in range(1, len(pieces), 3):
        message, kind, after = int(pieces[i]), pieces[i + 1], pieces[i + 2]
        answer = by_message[message]
        value = answer.content if kind == "a" else (answer.reasoning or "")
        written = _written_as(text, position, value, after)
        if written is None:
            raise fail(f"message {message}'s {'content' if kind == 'a' else 'reasoning'} is changed by the template")
        found.setdefault((message, kind), []).append((position, position + len(written)))
        position += len(written) + len(after)
    if position != len(text):
        raise fail("the rendering is not deterministic")
    spans = []
    for answer in answers:
        contents = found.get((answer.message, "a"), [])
        if len(contents) != 1:
            raise fail(f"message {answer.message}'s content appears {len(contents)} times")
        start, end = contents[0]
        reasoning = found.get((answer.message, "c"), [])
        if len(reasoning) == 1 and reasoning[0][0] <= start and reasoning[0][1] > reasoning[0][0]:
            start = reasoning[0][0]
        spans.append((start, end))
    return spans


def _written_as(text: str, position: int, value: str, after: str) -> str | None:
    """How the template wrote ``value`` at ``position`` (followed by the literal ``after``): as is, or stripped."""
    candidates = dict.fromkeys(
        [
            value,
            value.strip(),
            value.lstrip(),
            value.rstrip(),
            value.strip("\n"),
            value.lstrip("\n"),
            value.rstrip("\n"),
        ]
    )
    for candidate in candidates:
        if text.startswith(candidate + after, position) and (after or position + len(candidate) == len(text)):
            return candidate
    return None
