"""Plan style names -> configured style instances (SPEC §4, STYLE-2), read on the driver only.

:data:`STYLES` holds every built-in style of the SPEC §4 table and whatever the user adds with
:func:`register`. It is consulted once, on the driver, when plans are resolved
(:func:`raymoe.spec.plans.resolve_plans`): the resolved plans carry the *instances* their rules
name, and that launch spec is what every rank applies. So a style registered on the driver
reaches the ranks with the spec, and no rank ever reads this registry. The reference's DeepGEMM
Mega-MoE variants (SPEC STYLE-3) need that GPU kernel and are not offered.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from raymoe.parallel.styles.base import ParallelStyle
from raymoe.parallel.styles.builtin import builtin_styles


class StyleRegistry(Mapping[str, ParallelStyle]):
    """Name -> style instance. ``register`` adds one, ``unregister`` takes a user's one away (a replaced built-in
    comes back); ``check`` fails with the list of known names. The styles it was built with are its built-ins."""

    def __init__(self, styles: Mapping[str, ParallelStyle] | None = None) -> None:
        self._styles: dict[str, ParallelStyle] = {}
        self._builtin = dict(styles or {})
        for name, style in self._builtin.items():
            self.register(name, style)

    def unregister(self, name: str) -> ParallelStyle:
        """Remove the style registered as ``name`` and return it; a built-in replaced by ``register(...,
        replace=True)`` is restored. A ``ValueError`` for an unknown name or a built-in never replaced."""
        self.check(name, "unregister")
        style = self._styles[name]
        builtin = self._builtin.get(name)
        if builtin is not None and style is builtin:
            raise ValueError(f"unregister: {name!r} is a built-in style and stays registered (SPEC §4)")
        if builtin is not None:
            self._styles[name] = builtin
        else:
            del self._styles[name]
        return style

    def register(self, name: str, style: ParallelStyle, *, replace: bool = False) -> None:
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"style names are non-empty strings, got {name!r}")
        if not isinstance(style, ParallelStyle):
            raise TypeError(f"register({name!r}, ...) needs a ParallelStyle instance, got {type(style).__name__}")
        if name in self._styles and not replace:
            raise ValueError(
                f"style {name!r} is already registered ({self._styles[name]!r}); pass replace=True to override it"
            )
        self._styles[name] = style

    def check(self, name: str, where: str = "") -> None:
        """Raise ``ValueError`` unless ``name`` is registered; ``where`` says which plan entry asked."""
        check_style_name(self, name, where)

    def names(self) -> list[str]:
        return sorted(self._styles)

    def __getitem__(self, name: str) -> ParallelStyle:
        return self._styles[name]

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._styles))

    def __len__(self) -> int:
        return len(self._styles)


def check_style_name(styles: Mapping[str, ParallelStyle], name: str, where: str = "") -> None:
    """Raise ``ValueError`` unless ``styles`` has ``name``, listing the names it has."""
    if name in styles:
        return
    prefix = f"{where}: " if where else ""
    known = ", ".join(sorted(styles)) or "none"
    raise ValueError(f"{prefix}unknown style {name!r}; registered styles: {known} [PLAN-4]")


def register(name: str, style: ParallelStyle, *, replace: bool = False) -> None:
    """Add ``style`` under ``name`` to the driver's registry, so plans resolved afterwards can name it."""
    STYLES.register(name, style, replace=replace)


def unregister(name: str) -> ParallelStyle:
    """Take a style added with :func:`register` off the driver's registry (a replaced built-in comes back)."""
    return STYLES.unregister(name)


STYLES = StyleRegistry(builtin_styles())
