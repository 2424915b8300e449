"""Parallel styles: the base class (its hooks and type flags), the built-in styles and the driver's registry.

``base.py`` is the contract (SPEC STYLE-1); ``tensor.py`` the dense tensor-parallel styles,
``moe.py`` the TP experts, ``expert.py`` the expert-parallel styles with ``dispatch.py`` their
token all-to-alls, ``layouts.py`` the activation layout changes they share; ``builtin.py`` names
them as the SPEC §4 table does and ``registry.py`` is where plans look names up, on the driver.
The reference's DeepGEMM Mega-MoE styles need that GPU kernel (SPEC STYLE-3) and are not offered.
"""

from raymoe.parallel.styles.base import ExpertRole, ParallelStyle
from raymoe.parallel.styles.builtin import builtin_styles
from raymoe.parallel.styles.registry import STYLES, StyleRegistry, check_style_name, register, unregister

__all__ = [
    "STYLES",
    "ExpertRole",
    "ParallelStyle",
    "StyleRegistry",
    "builtin_styles",
    "check_style_name",
    "register",
    "unregister",
]
