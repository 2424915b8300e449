"""Asking the nodes that host ranks whether they see the driver's local paths (the rule:
:mod:`raymoe.spec.shared_paths`).

    check_nodes_see(needs, node_of_rank)   one zero-CPU task on each node hosting ranks, other than the driver's,
                                           pinned there; their answers -> check_seen (one ValueError)

Nothing runs when every rank is on the driver's node. A node that does not answer within ``timeout_s`` is an error
too (it would not load the model either).
"""

from __future__ import annotations

from collections.abc import Sequence

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raymoe.spec.shared_paths import SharedPath, check_seen, problems_on_node

# A probe starts a worker process on the node (Ray's, with raymoe imported), as placing a rank there does: the group
# gives it the placement's own patience (RayGroupOptions.placement_timeout_s); this is the default of a bare call.
PROBE_TIMEOUT_S = 120.0


@ray.remote(num_cpus=0)
def _problems_here(needs: Sequence[SharedPath]) -> list[str]:
    return problems_on_node(needs)


def check_nodes_see(
    needs: Sequence[SharedPath],
    node_of_rank: Sequence[str],
    *,
    driver_node: str | None = None,
    timeout_s: float = PROBE_TIMEOUT_S,
) -> None:
    """Raise ``ValueError`` (:func:`~raymoe.spec.shared_paths.check_seen`) when a node hosting ranks (``node_of_rank``:
    Ray node ids, rank order) does not see ``needs``; the driver's node (default: this process's) is not asked."""
    if not needs:
        return
    here = driver_node if driver_node is not None else ray.get_runtime_context().get_node_id()
    ranks_on: dict[str, list[int]] = {}
    for rank, node in enumerate(node_of_rank):
        if node != here:
            ranks_on.setdefault(node, []).append(rank)
    if not ranks_on:
        return
    address = {node["NodeID"]: node["NodeManagerAddress"] for node in ray.nodes()}
    refs = {
        node: _problems_here.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(
            list(needs)
        )
        for node in ranks_on
    }
    seen: dict[str, tuple[Sequence[int], Sequence[str]]] = {}
    for node, ref in refs.items():
        name = f"{address.get(node, '?')} ({node[:8]})"
        try:
            problems = ray.get(ref, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            ray.cancel(ref, force=True)
            problems = [f"it did not answer within {timeout_s:g} s"]
        seen[name] = (ranks_on[node], problems)
    check_seen(needs, seen)
