"""The Ray side of raymoe: rank actors, their placement and the driver-side group."""

from actors.group import GroupOptions, RankError, RankGroup
from actors.placement import PlacementError

__all__ = ["GroupOptions", "PlacementError", "RankError", "RankGroup"]
