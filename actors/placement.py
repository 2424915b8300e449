"""Where ranks run: preflight against the cluster, a placement group, node-ordered ranks (SPEC RAY-1).

One bundle per rank (``{"GPU": 1, "CPU": k}`` on GPU clusters, ``{"CPU": k}`` without GPUs). What a rank
gets besides its bundle follows ``use_gpu`` (:func:`rank_backend`, :func:`rank_env`): without GPUs, gloo and no
visible GPU (Ray leaves ``CUDA_VISIBLE_DEVICES`` as the node has it for an actor of zero GPUs), with GPUs NCCL
unless gloo is asked for.
Ranks are numbered node by node, so the consecutive ranks of a tp group and of an ep group
share a node and ``dp_replicate`` spans nodes (TOPO-5)::

    node A: ranks 0..7  (replica 0)      node B: ranks 8..15  (replica 1)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import ray
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group

from raymoe.rank.contract import Backend
from raymoe.spec.topology import Axis, Topology

VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"


def node_block(topology: Topology) -> int:
    """How many consecutive ranks must share a node: a tp group, or an ep group (TOPO-5)."""
    return max(topology.axis_size(Axis.TP), topology.axis_size(Axis.EP))


def rank_backend(use_gpu: bool, backend: Backend | None) -> Backend:
    """Pure: the backend ranks placed with ``use_gpu`` run (``backend``: the caller's choice, None: the default).

    Without GPUs, gloo (NCCL there is a ValueError); with GPUs, ``backend`` or NCCL. The ranks get it explicitly,
    never guessing from the GPUs they happen to see.
    """
    if use_gpu:
        return backend if backend is not None else "nccl"
    if backend == "nccl":
        raise ValueError(
            "backend='nccl' with use_gpu=False: NCCL runs on GPUs and a rank placed without one has none; "
            "pass use_gpu=True, or backend='gloo' (or None)"
        )
    return "gloo"


def rank_env(use_gpu: bool) -> dict[str, str]:
    """Pure: environment variables a rank actor starts with: without GPUs, ``CUDA_VISIBLE_DEVICES=""`` so torch in
    the rank sees none (set before the process starts, so before torch initialises CUDA); with GPUs none (Ray
    shows each rank its own GPU)."""
    return {} if use_gpu else {VISIBLE_DEVICES: ""}


class PlacementError(RuntimeError):
    """The cluster cannot host the requested ranks, or did not within the timeout."""


@dataclass(frozen=True)
class NodeCapacity:
    node_id: str
    address: str
    cpus: float
    gpus: float


@dataclass(frozen=True)
class PlacementRequest:
    """What the ranks need: ``block`` consecutive ranks (a tp or ep group) must share a node."""

    world_size: int
    use_gpu: bool
    cpus_per_rank: float
    block: int

    @classmethod
    def for_topology(cls, topology: Topology, use_gpu: bool, cpus_per_rank: float) -> PlacementRequest:
        return cls(topology.world_size, use_gpu, cpus_per_rank, node_block(topology))

    def bundle(self) -> dict[str, float]:
        return {"GPU": 1.0, "CPU": self.cpus_per_rank} if self.use_gpu else {"CPU": self.cpus_per_rank}

    def ranks_on(self, node: NodeCapacity) -> int:
        """How many whole groups of ``block`` ranks fit on ``node``, in ranks."""
        by_cpu = math.floor(node.cpus / self.cpus_per_rank) if self.cpus_per_rank else self.world_size
        fits = min(by_cpu, math.floor(node.gpus)) if self.use_gpu else by_cpu
        return fits // self.block * self.block


@dataclass(frozen=True)
class Placement:
    """A ready placement group and, for each rank, its bundle index and node."""

    group: PlacementGroup
    bundle_of_rank: tuple[int, ...]
    node_of_rank: tuple[str, ...]

    def local_rank(self, rank: int) -> int:
        """Index of ``rank`` among the ranks on its node."""
        node = self.node_of_rank[rank]
        return sum(1 for r in range(rank) if self.node_of_rank[r] == node)

    def check_blocks(self, block: int) -> None:
        """Raise ``PlacementError`` if some ``block`` consecutive ranks (a tp or ep group) span two nodes."""
        _check_blocks(self.node_of_rank, block)

    def remove(self) -> None:
        remove_placement_group(self.group)


def cluster_nodes() -> list[NodeCapacity]:
    """Alive nodes of the connected Ray cluster with their total CPUs and GPUs."""
    return [
        NodeCapacity(
            node_id=node["NodeID"],
            address=node["NodeManagerAddress"],
            cpus=float(node["Resources"].get("CPU", 0.0)),
            gpus=float(node["Resources"].get("GPU", 0.0)),
        )
        for node in ray.nodes()
        if node.get("Alive")
    ]


def check_fits(request: PlacementRequest, nodes: list[NodeCapacity]) -> None:
    """Preflight: raise ``PlacementError`` saying what is missing, before any actor starts."""
    if sum(request.ranks_on(node) for node in nodes) >= request.world_size:
        return
    unit = "GPUs" if request.use_gpu else f"rank slots of {request.cpus_per_rank:g} CPUs"
    groups = f" in groups of {request.block} per node" if request.block > 1 else ""
    raise PlacementError(
        f"needs {request.world_size} {unit}{groups}, cluster has {_describe_nodes(nodes, request)}; "
        "add nodes, or choose sizes whose tp/ep groups fit on one node"
    )


def _describe_nodes(nodes: list[NodeCapacity], request: PlacementRequest) -> str:
    if not nodes:
        return "no alive nodes"
    if request.use_gpu:
        counts = [int(node.gpus) for node in nodes]
        unit = "GPUs"
    else:
        counts = [int(node.cpus) for node in nodes]
        unit = "CPUs"
    if len(set(counts)) == 1:
        return f"{len(nodes)} node{'s' if len(nodes) > 1 else ''} x {counts[0]} {unit}"
    return f"{len(nodes)} nodes with {', '.join(map(str, counts))} {unit}"


def place(request: PlacementRequest, timeout_s: float) -> Placement:
    """Reserve one bundle per rank and order ranks by node; never waits longer than ``timeout_s``."""
    group = placement_group([request.bundle()] * request.world_size, strategy="PACK")
    try:
        ray.get(group.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(group)
        raise PlacementError(
            f"the placement group for {request.world_size} ranks ({request.bundle()} each) was not ready after "
            f"{timeout_s:g} s: the resources exist but are busy (other jobs or actors hold them); "
            "free them or raise placement_timeout_s"
        ) from None
    try:
        return _order_by_node(group, request)
    except PlacementError:
        remove_placement_group(group)
        raise


def _order_by_node(group: PlacementGroup, request: PlacementRequest) -> Placement:
    bundle_nodes: dict[int, str] = placement_group_table(group)["bundles_to_node_id"]
    first_seen = {node: index for index, node in reversed(list(bundle_nodes.items()))}
    bundles = sorted(bundle_nodes, key=lambda b: (first_seen[bundle_nodes[b]], b))
    nodes = tuple(bundle_nodes[b] for b in bundles)
    _check_blocks(nodes, request.block)
    return Placement(group, tuple(bundles), nodes)


def _check_blocks(node_of_rank: tuple[str, ...], block: int) -> None:
    for start in range(0, len(node_of_rank), block):
        if len(set(node_of_rank[start : start + block])) > 1:
            raise PlacementError(
                f"ranks {start}..{start + block - 1} are on different nodes, so a tp/ep group of {block} would "
                f"cross nodes; give every node a multiple of {block} free slots (or start the world with block={block})"
            )
