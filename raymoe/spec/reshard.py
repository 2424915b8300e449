"""Whether FSDP2 units keep their gathered weights from forward to backward (``DistributedConfig``'s
``fsdp_reshard_after_forward``; applied on the ranks by :func:`raymoe.parallel.fsdp.keep_gathered_after_forward`).

A unit that frees its gathered weights after forward gathers them again in backward: two all-gathers a step, and at
most two layers' weights gathered at once. A unit that keeps them gathers once a step, and holds every kept unit's
weights (in the dtype they compute in) from the end of its forward to its backward::

    choice     units that keep                                   all-gathers a step   gathered at the peak
    "always"   the fsdp_plan's keep_full_weight units            2 per layer          2 layers
               (the final norm and the head)
    "never"    every unit                                        1 per layer          every layer
    "auto"     every unit, where the rank's gathered weights      1 per layer          every layer
               take at most 1/KEEP_SHARE of its free device
               memory (the smallest share of all ranks decides)
               else the plan's, and the last decoder layer        2 per layer, 1 for   2 layers
               (its backward comes first: gathering it again       the last
               frees nothing)

``auto`` is the default: a model whose gathered weights are small beside the device's memory (small models,
models split finely by TP / EP) skips a third of FSDP2's traffic; a large one keeps FSDP2's memory bound.
"""

from __future__ import annotations

from typing import Literal

ReshardChoice = Literal["auto", "always", "never"]
KEEP_SHARE = 8


def keeps_every_unit(choice: ReshardChoice, gathered_bytes: int, free_bytes: int) -> bool:
    """Whether every FSDP2 unit keeps its gathered weights until backward, for a rank whose units gather
    ``gathered_bytes`` in all and whose device has ``free_bytes`` free (under ``auto``: the smallest of all ranks')."""
    if choice == "never":
        return True
    if choice == "always":
        return False
    return gathered_bytes * KEEP_SHARE <= free_bytes


def keeps_last_layer(choice: ReshardChoice) -> bool:
    """Whether the last decoder layer keeps its gathered weights where not every unit does (``auto``)."""
    return choice == "auto"


def describe_reshard(choice: ReshardChoice, every_unit: bool) -> str:
    """One line for ``describe()``: what the ranks decided under ``choice``."""
    if every_unit:
        return f"FSDP2 (fsdp_reshard_after_forward={choice}): every unit keeps its gathered weights until backward"
    kept = ", and the last decoder layer" if keeps_last_layer(choice) else ""
    return (
        f"FSDP2 (fsdp_reshard_after_forward={choice}): units free their gathered weights after forward as the "
        f"fsdp plan says{kept}"
    )
