"""One registry from plan style names to configured style instances (SPEC §4, STYLE-2).

Only styles that are really implemented are registered; names from the SPEC §4 table that
are not implemented yet give an error saying so, never a silent fallback. The reference's
DeepGEMM Mega-MoE variants (SPEC STYLE-3) need that GPU kernel and are not offered.
"""

from __future__ import annotations

from collections.abc import Iterator

from raymoe.styles.base import ParallelStyle

# Every style name of the SPEC §4 table. One that is not registered is reported as
# "not implemented yet" rather than unknown; later work registers them as they land.
SPEC_STYLE_NAMES = (
    "embedding_rowwise",
    "embedding_colwise",
    "colwise",
    "colwise_gather_output",
    "colwise_rep",
    "rowwise",
    "rowwise_split_input",
    "rowwise_rep",
    "packed_colwise",
    "packed_rowwise",
    "sequence_parallel",
    "replicated_with_grad_allreduce",
    "mla_kv_a_proj",
    "all_reduce",
    "moe_tp_experts",
    "moe_identity_expert",
    "local_params",
    "grouped_gemm",
    "ep_router",
    "ep_dispatch_experts",
)


class StyleRegistry:
    """Name -> style instance. ``register`` adds one; ``get`` fails with the list of known names."""

    def __init__(self) -> None:
        self._styles: dict[str, ParallelStyle] = {}

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

    def get(self, name: str) -> ParallelStyle:
        self.check(name)
        return self._styles[name]

    def check(self, name: str, where: str = "") -> None:
        """Raise ``ValueError`` unless ``name`` is registered; ``where`` says which plan entry asked."""
        if name in self._styles:
            return
        prefix = f"{where}: " if where else ""
        known = ", ".join(sorted(self._styles)) or "none"
        if name in SPEC_STYLE_NAMES:
            reason = f"style {name!r} is in SPEC §4 but not implemented in raymoe yet"
        else:
            reason = f"unknown style {name!r}"
        raise ValueError(f"{prefix}{reason}; registered styles: {known} [PLAN-4]")

    def copy(self) -> StyleRegistry:
        """A registry with the same entries, to rebind some of them without touching this one."""
        duplicate = StyleRegistry()
        duplicate._styles = dict(self._styles)
        return duplicate

    def names(self) -> list[str]:
        return sorted(self._styles)

    def __contains__(self, name: object) -> bool:
        return name in self._styles

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._styles))

    def __len__(self) -> int:
        return len(self._styles)


STYLES = StyleRegistry()


def register(name: str, style: ParallelStyle, *, replace: bool = False) -> None:
    """Add ``style`` under ``name`` to the global registry, so plans can name it."""
    STYLES.register(name, style, replace=replace)
