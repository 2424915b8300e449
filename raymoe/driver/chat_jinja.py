"""The sandboxed Jinja environment chat templates render in, built as transformers 5 builds it.

``ImmutableSandboxedEnvironment`` with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension,
transformers' ``tojson`` filter (no HTML escaping), ``raise_exception``, ``strftime_now``, a ``dict`` without
access to the type, a ``namespace`` that refuses underscore attributes, and ``{% generation %}`` blocks whose
character spans are recorded while a :class:`GenerationTracker` is active (transformers' assistant mask).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.runtime
from jinja2.sandbox import ImmutableSandboxedEnvironment


def uses_generation_tags(source: str) -> bool:
    return re.search(r"\{\%-?\s*generation\s*-?\%\}", source) is not None


class GenerationTracker(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: renders its body and, while tracking, records its character span."""

    tags = {"generation"}  # noqa: RUF012 (jinja's own class attribute)

    def __init__(self, environment: jinja2.Environment) -> None:
        super().__init__(environment)
        self._blocks: list[str] | None = None
        self._spans: list[tuple[int, int]] | None = None

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_generation", []), [], [], body).set_lineno(lineno)

    def _generation(self, caller: jinja2.runtime.Macro) -> str:
        rendered = str(caller())
        if self._blocks is not None and self._spans is not None:
            start = len("".join(self._blocks))
            self._spans.append((start, start + len(rendered)))
        return rendered

    @contextmanager
    def active(self, blocks: list[str], spans: list[tuple[int, int]]) -> Iterator[None]:
        self._blocks, self._spans = blocks, spans
        try:
            yield
        finally:
            self._blocks, self._spans = None, None


def generation_tracker(environment: jinja2.Environment) -> GenerationTracker:
    extension = environment.extensions[f"{GenerationTracker.__module__}.{GenerationTracker.__qualname__}"]
    assert isinstance(extension, GenerationTracker)
    return extension


class _TemplateDict:
    """``dict(...)`` in templates without attribute access to the type itself (as transformers has it)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """``namespace(...)`` refusing underscore attributes (no route to interpreter internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]
        attributes = dict(*rest, **kwargs)
        for name in attributes:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attributes)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore attributes ({name!r})")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # transformers' filter: no HTML escaping, unicode kept.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTracker, jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    environment.globals["dict"] = _TemplateDict()
    environment.globals["namespace"] = _TemplateNamespace
    try:
        return environment.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"the chat template is not valid Jinja (line {exc.lineno}: {exc.message})") from None
