"""The Ray side of raymoe, and the only package that imports ``ray``: rank actors, their placement,
the driver-side group of them, and connecting the driver to a cluster."""

from actors.group import GroupOptions, RankError, RankHangError, RayRankGroup
from actors.placement import PlacementError

__all__ = ["GroupOptions", "PlacementError", "RankError", "RankHangError", "RayRankGroup"]
