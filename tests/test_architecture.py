"""The layout rules of ARCHITECTURE.md, checked by parsing every module's imports (no module is imported).

    models      pure torch: imports nothing else of raymoe
    checkpoint  hub files: models
    parallel    styles, FSDP2: models
    spec        driver, pure: models, parallel (style types), checkpoint (config.json)
    rank        inside a rank actor: models, parallel, spec, checkpoint
    driver      handle and Trainer: models, spec, checkpoint, rank (the functions it sends)
    actors      Ray: rank, spec, and the only package that imports ray
    raymoe.cli  the command line (driver, no cluster): models, spec, checkpoint, driver, rank (the simulated
                worlds of ``raymoe plan``, as tests use a LocalRankGroup)

``raymoe/api.py`` is the composition root: the one raymoe module that imports ``actors``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ALLOWED = {
    "models": set(),
    "checkpoint": {"models"},
    "parallel": {"models"},
    "spec": {"models", "parallel", "checkpoint"},
    "rank": {"models", "parallel", "spec", "checkpoint"},
    "driver": {"models", "spec", "checkpoint", "rank"},
    "actors": {"rank", "spec", "ray"},
    "raymoe.cli": {"models", "spec", "checkpoint", "driver", "rank"},
}
MODULES = sorted([*(ROOT / "raymoe").rglob("*.py"), *(ROOT / "actors").rglob("*.py")])


def room(path: Path) -> str:
    """``models`` for raymoe/models/..., ``actors`` for actors/..., the file name for raymoe's top-level modules."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    if parts[0] == "actors":
        return "actors"
    return parts[1] if len(parts) > 2 else f"raymoe.{parts[1]}"


def imported(path: Path) -> set[str]:
    """The rooms ``path`` imports from, other than its own."""
    return imported_rooms(path.read_text()) - {room(path)}


def imported_rooms(source: str) -> set[str]:
    """What ``source`` imports, as the room each import lands in (``ray`` for Ray), at any depth of the file."""
    targets = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "raymoe" and len(parts) > 1:
                targets.add(parts[1] if (ROOT / "raymoe" / parts[1]).is_dir() else f"raymoe.{parts[1]}")
            elif parts[0] in ("actors", "ray"):
                targets.add(parts[0])
    return targets


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_each_room_imports_only_what_it_may(path):
    here = room(path)
    if here not in ALLOWED:  # raymoe/__init__.py and raymoe/api.py compose the rooms
        assert here in ("raymoe.__init__", "raymoe.api"), f"{path}: a module outside the rooms"
        return
    extra = imported(path) - ALLOWED[here]
    assert not extra, f"{path.relative_to(ROOT)} ({here}/) imports {sorted(extra)}; allowed: {sorted(ALLOWED[here])}"


def test_ray_is_imported_only_in_actors_and_actors_only_by_the_api():
    ray_users = {str(p.relative_to(ROOT)) for p in MODULES if "ray" in imported(p)}
    actors_users = {str(p.relative_to(ROOT)) for p in MODULES if room(p) != "actors" and "actors" in imported(p)}
    assert ray_users and all(user.startswith("actors/") for user in ray_users), ray_users
    assert actors_users == {"raymoe/api.py"}


def test_the_checker_sees_an_import_inside_a_function():
    source = (ROOT / "raymoe" / "models" / "common" / "norm.py").read_text()
    assert "parallel" not in imported_rooms(source)
    late = source + "\n\ndef _late():\n    from raymoe.parallel.styles import STYLES\n\n    import ray\n"
    assert {"parallel", "ray"} <= imported_rooms(late)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_module_says_what_it_is_on_its_first_line(path):
    docstring = ast.get_docstring(ast.parse(path.read_text()), clean=False)
    assert docstring and docstring.strip().splitlines()[0].strip(), f"{path.relative_to(ROOT)} has no first line"
    assert path.read_text().startswith('"""'), f"{path.relative_to(ROOT)}: the docstring is not the first line"


def test_importing_raymoe_imports_neither_ray_nor_transformers():
    """``import raymoe`` stays free of Ray: api.py imports actors only inside its functions; transformers is the
    tests' reference and no module imports it."""
    api = ast.parse((ROOT / "raymoe" / "api.py").read_text())
    top_level = {node.module for node in api.body if isinstance(node, ast.ImportFrom)}
    assert not {name for name in top_level if name and name.split(".")[0] == "actors"}
    inside = {n.module for n in ast.walk(api) if isinstance(n, ast.ImportFrom) and n.module} - top_level
    assert any(name.startswith("actors") for name in inside)  # the checker would see a top-level one
    for path in MODULES:
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            assert not any(name.split(".")[0] == "transformers" for name in names), path


def test_the_public_names_are_the_lazy_ones_and_a_rank_imports_no_driver_module():
    """``raymoe.X`` is imported on first use (raymoe/__init__.py's ``_HOME``): every name of ``__all__`` resolves to
    the object its home module defines, and a rank process (``import actors.rank``) loads no ``raymoe.driver``
    module."""
    import importlib
    import subprocess
    import sys

    import raymoe

    assert sorted(raymoe.__all__) == sorted(raymoe._HOME)
    for name in raymoe.__all__:
        assert getattr(raymoe, name) is getattr(importlib.import_module(raymoe._HOME[name]), name), name
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        raymoe.nope  # noqa: B018
    probe = "import sys, actors.rank; print(sorted(m for m in sys.modules if m.startswith('raymoe.driver')))"
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]", done.stdout


DRIVER = sorted((ROOT / "raymoe" / "driver").glob("*.py"))


@pytest.mark.parametrize("path", DRIVER, ids=lambda p: p.name)
def test_the_driver_takes_from_the_rank_room_only_the_contract_and_rank_functions(path):
    """A driver module imports the messages of ``rank/contract.py`` and the ``fn(ctx, ...)`` functions it sends,
    never a rank module's internals (its classes, helpers, constants)."""
    import importlib
    import inspect

    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.ImportFrom) or not (node.module or "").startswith("raymoe.rank"):
            continue
        if node.module == "raymoe.rank.contract":
            continue
        module = importlib.import_module(node.module)
        for alias in node.names:
            value = getattr(module, alias.name)
            params = list(inspect.signature(value).parameters) if inspect.isfunction(value) else []
            assert params[:1] == ["ctx"], f"{path.name} imports {node.module}.{alias.name}: not a rank function"


def test_the_largest_driver_module_is_under_400_lines():
    sizes = {path.name: len(path.read_text().splitlines()) for path in DRIVER}
    assert max(sizes.values()) < 400, sorted(sizes.items(), key=lambda item: -item[1])[:3]
