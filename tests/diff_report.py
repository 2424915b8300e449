"""Opt-in pytest plugin: report the largest relative error each test measured.

    .venv/bin/python -m pytest -p tests.diff_report tests/actors/test_layouts.py

Tests assert their tolerances; this prints how far inside them they are, for issue notes. It
wraps the module-level ``rel_error(actual, expected)`` of every collected test module that has one.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

_worst: dict[str, float] = {}
_current = [""]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        module = getattr(item, "module", None)
        if module is None or not hasattr(module, "rel_error") or getattr(module, "_diff_report", False):
            continue
        measure = module.rel_error

        def recorded(actual: Any, expected: Any, _measure: Any = measure) -> float:
            error = float(_measure(actual, expected))
            _worst[_current[0]] = max(_worst.get(_current[0], 0.0), error)
            return error

        module.rel_error = recorded
        module._diff_report = True


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    _current[0] = item.nodeid
    return (yield)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    terminalreporter.write_sep("-", "largest relative error per test (rel_error)")
    for nodeid, error in sorted(_worst.items()):
        terminalreporter.write_line(f"{error:9.2e}  {nodeid}")
