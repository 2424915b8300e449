"""Parallel styles: the base class and the registry plans name them through."""

from raymoe.styles.base import ParallelStyle
from raymoe.styles.registry import STYLES, StyleRegistry, register

__all__ = ["STYLES", "ParallelStyle", "StyleRegistry", "register"]
