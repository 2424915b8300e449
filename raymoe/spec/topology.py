"""Which rank does what: coordinates and process groups of a layout (SPEC §2, TOPO-1…TOPO-5).

Pure functions of a :class:`~raymoe.spec.config.DistributedConfig` and a world size; nothing here
touches a process group. Ranks are laid out row-major with tp innermost, in two views of the
same ranks (a rank's id is the same in both)::

    dense  view  (dp_replicate, pp, fsdp, cp, tp)    attention, dense MLPs, embeddings, norms
    expert view  (dp_replicate, pp, efsdp,    ep)    expert weights;  efsdp * ep == fsdp * cp * tp

    rank = (((dp_replicate * pp_size + pp) * fsdp_size + fsdp) * cp_size + cp) * tp_size + tp
         = ((dp_replicate * pp_size + pp) * efsdp_size + efsdp) * ep_size + ep

A pipeline stage (pp coordinate) is a block of ``fsdp_size * cp_size * tp_size`` consecutive ranks inside its
replica; the TOPO rules below hold inside each stage.

Every stage of a replica sees the same batches: the first stage reads the token ids, the last the labels, and the
last stage's first tp rank answers::

    pp=2, fsdp=2, tp=1
    rank     0    1    2    3
    stage    0    0    1    1        layers split between the stages (raymoe.spec.pipeline)
    batch    B0   B1   B0   B1       rank 0 sends its activations to rank 2, rank 1 to rank 3

Context parallelism (``cp_size > 1``): the cp ranks of a batch hold the same rows, each a share of every sequence
(chunks ``c`` and ``2 * cp_size - 1 - c`` of ``2 * cp_size``, :mod:`raymoe.parallel.context_parallel`); the answering
rank is the batch's first (cp 0, tp 0) of the last stage::

    cp=2, fsdp=2, tp=1, every row cut into 4 chunks c0 c1 c2 c3
    rank     0       1       2       3
    batch    [=====B0=====]  [=====B1=====]
    cp       0       1       0       1
    chunks   c0 c3   c1 c2   c0 c3   c1 c2

tp=2, fsdp=4, 8 experts (SPEC TOPO-3)::

    rank         0      1       2      3       4      5       6      7
    batch       [====B0====]   [====B1====]   [====B2====]   [====B3====]     one batch per TP pair
    ep_size=4   E0E1   E2E3    E4E5   E6E7    E0E1   E2E3    E4E5   E6E7     group = two pairs,   efsdp_size=2

Consecutive ranks form a tp group and share a batch; the batch depends only on the
(dp_replicate, fsdp) coordinate (TOPO-1). ``ep_size`` consecutive ranks hold one full set of
experts; ranks at the same ep position in different sets form an efsdp group (TOPO-2). Each
replica (dp_replicate coordinate) is a node-sized block of consecutive ranks (TOPO-5).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from enum import StrEnum

from raymoe.spec.config import DistributedConfig


class Axis(StrEnum):
    """Mesh axis names, shared with the DeviceMeshes the runtime builds."""

    DP_REPLICATE = "dp_replicate"
    PP = "pp"
    FSDP = "fsdp"
    CP = "cp"
    TP = "tp"
    EFSDP = "efsdp"
    EP = "ep"


DENSE_AXES = (Axis.DP_REPLICATE, Axis.PP, Axis.FSDP, Axis.CP, Axis.TP)
EXPERT_AXES = (Axis.DP_REPLICATE, Axis.PP, Axis.EFSDP, Axis.EP)
# FSDP2 shards dense parameters over fsdp and cp together (torchtitan's dp_shard_cp): both axes are adjacent in the
# dense view, so the ranks of one such group are the flattened (fsdp, cp) sub-mesh.
FSDP_CP = "fsdp_cp"


@dataclass(frozen=True)
class RankCoords:
    """One rank's position on every axis, and the data-parallel batch it holds."""

    rank: int
    dp_replicate: int
    pp: int
    fsdp: int
    tp: int
    efsdp: int
    ep: int
    batch: int
    cp: int = 0

    def on(self, axis: Axis) -> int:
        return int(getattr(self, axis.value))

    def label(self) -> str:
        """``rank 5 (dp_replicate=0, pp=0, fsdp=2, cp=0, tp=1, ep=1, efsdp=1)``: how errors name a rank."""
        axes = ", ".join(f"{axis.value}={self.on(axis)}" for axis in (*DENSE_AXES, Axis.EP, Axis.EFSDP))
        return f"rank {self.rank} ({axes})"


@dataclass(frozen=True)
class Topology:
    """The coordinates and groups of every rank of a resolved layout."""

    config: DistributedConfig
    ranks: tuple[RankCoords, ...]

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    def axis_size(self, axis: Axis) -> int:
        sizes = {
            Axis.DP_REPLICATE: self.config.dp_replicate_size,
            Axis.PP: self.config.pp_size,
            Axis.FSDP: self.config.fsdp_size,
            Axis.CP: self.config.cp_size,
            Axis.TP: self.config.tp_size,
            Axis.EFSDP: self.config.efsdp_size,
            Axis.EP: self.config.ep_size,
        }
        size = sizes[axis]
        assert size is not None  # a Topology is only built from a resolved config
        return size

    def mesh_shape(self, axes: tuple[Axis, ...]) -> tuple[int, ...]:
        """Shape of the row-major view over ``axes`` (DENSE_AXES or EXPERT_AXES)."""
        return tuple(self.axis_size(axis) for axis in axes)

    def groups(self, axis: Axis) -> tuple[tuple[int, ...], ...]:
        """Every group of ``axis``, as ascending rank lists, in order of their first rank."""
        view = DENSE_AXES if axis in DENSE_AXES else EXPERT_AXES
        return _row_major_groups(self.mesh_shape(view), view.index(axis))

    def group_of(self, rank: int, axis: Axis) -> tuple[int, ...]:
        """The ``axis`` group that contains ``rank``."""
        return next(group for group in self.groups(axis) if rank in group)

    def experts_of(self, rank: int, num_experts: int) -> range:
        """Global expert ids whose weights ``rank`` holds: block ``ep`` of ``ep_size`` (TOPO-2)."""
        return _expert_block(self.ranks[rank].ep, self.axis_size(Axis.EP), num_experts)

    def batch_ranks(self) -> tuple[tuple[int, ...], ...]:
        """Ranks that hold batch ``b`` at index ``b``: its cp x tp ranks in each pipeline stage (TOPO-1)."""
        return tuple(tuple(r.rank for r in self.ranks if r.batch == b) for b in range(self.config.dp_size))

    def answer_ranks(self) -> tuple[int, ...]:
        """The rank that answers for batch ``b`` at index ``b``: the first (cp 0, tp 0) rank of the last stage."""
        last = self.axis_size(Axis.PP) - 1
        return tuple(next(r for r in ranks if self.ranks[r].pp == last) for ranks in self.batch_ranks())

    def answers(self, rank: int) -> bool:
        """True for the rank that returns its batch rows' results (:meth:`answer_ranks`)."""
        coords = self.ranks[rank]
        return coords.tp == 0 and coords.cp == 0 and coords.pp == self.axis_size(Axis.PP) - 1

    def describe(self, num_experts: int | None = None, ep_sizes: tuple[int, ...] | None = None) -> str:
        """The rank picture of SPEC TOPO-3.

        One expert row per size in ``ep_sizes`` (default: this layout's ep_size when > 1), so
        alternative expert layouts over the same dense layout can be compared side by side.
        Expert rows name expert ids when ``num_experts`` is given, else the ep coordinate.
        """
        return _Picture(self).render(num_experts, ep_sizes)


def build_topology(config: DistributedConfig, world_size: int | None = None) -> Topology:
    """Coordinates and groups for ``config`` on ``world_size`` ranks (default: the config's own)."""
    if world_size is not None or config.tp_is_deferred:
        if world_size is None:
            raise ValueError("build_topology: tp_size is deferred (tp_plan='auto'); pass the world_size to infer it")
        config = config.resolve(world_size)
    replicas, fsdp, tp = (config.dp_replicate_size, config.fsdp_size, config.tp_size)
    ep, pp, cp = config.ep_size, config.pp_size, config.cp_size
    assert replicas is not None and fsdp is not None and tp is not None and ep is not None and pp is not None
    assert cp is not None
    ranks = []
    for rank in range(config.world_size):
        block, in_stage = divmod(rank, fsdp * cp * tp)
        replica, stage = divmod(block, pp)
        ranks.append(
            RankCoords(
                rank=rank,
                dp_replicate=replica,
                pp=stage,
                fsdp=in_stage // (cp * tp),
                tp=in_stage % tp,
                efsdp=in_stage // ep,
                ep=in_stage % ep,
                batch=replica * fsdp + in_stage // (cp * tp),
                cp=in_stage // tp % cp,
            )
        )
    return Topology(config=config, ranks=tuple(ranks))


def _row_major_groups(shape: tuple[int, ...], axis: int) -> tuple[tuple[int, ...], ...]:
    """Rank lists that vary only along ``axis`` of a row-major arange(prod(shape)).reshape(shape)."""
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    others = [range(n) if i != axis else range(1) for i, n in enumerate(shape)]
    groups = []
    for index in itertools.product(*others):
        base = sum(i * s for i, s in zip(index, strides, strict=True))
        groups.append(tuple(base + k * strides[axis] for k in range(shape[axis])))
    return tuple(sorted(groups))


def _expert_block(ep_coord: int, ep_size: int, num_experts: int) -> range:
    if num_experts % ep_size:
        raise ValueError(f"num_experts={num_experts} must be divisible by ep_size={ep_size} [CFG-3]")
    per_rank = num_experts // ep_size
    return range(ep_coord * per_rank, (ep_coord + 1) * per_rank)


_NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")


class _Picture:
    """Text rendering of a topology; column widths follow the SPEC TOPO-3 picture."""

    LABEL_WIDTH = 12
    MIN_CELL = 7

    def __init__(self, topology: Topology) -> None:
        self.topo = topology
        self.tp = topology.axis_size(Axis.TP)
        self.cp = topology.axis_size(Axis.CP)

    def render(self, num_experts: int | None, ep_sizes: tuple[int, ...] | None) -> str:
        own_ep = self.topo.axis_size(Axis.EP)
        sizes = ep_sizes if ep_sizes is not None else ((own_ep,) if own_ep > 1 else ())
        expert_rows = [self._expert_cells(ep, num_experts) for ep in sizes]
        self.cell = max([self.MIN_CELL, *(len(c) + 2 for cells, _ in expert_rows for c in cells)])
        lines = [self._row("rank", [f"{r.rank:>2}" for r in self.topo.ranks])]
        if self.topo.axis_size(Axis.DP_REPLICATE) > 1:
            lines.append(self._row("replica", [f"{r.dp_replicate:>2}" for r in self.topo.ranks]))
        if self.topo.axis_size(Axis.PP) > 1:
            lines.append(self._row("stage", [f"{r.pp:>2}" for r in self.topo.ranks]))
        lines.append(self._batch_row())
        if self.cp > 1:
            last = 2 * self.cp - 1
            lines.append(self._row("cp", [f"{r.cp:>2}" for r in self.topo.ranks]))
            chunks = [f"c{r.cp}c{last - r.cp}" for r in self.topo.ranks]
            lines.append(self._row("chunks", chunks, f"every row in {2 * self.cp} chunks, two per cp rank"))
        if self.tp > 1:
            lines.append(self._row("tp", [f"{r.tp:>2}" for r in self.topo.ranks]))
        for ep, (cells, note) in zip(sizes, expert_rows, strict=True):
            lines.append(self._row(f"ep_size={ep}", cells, note))
        return "\n".join(lines)

    def _row(self, label: str, cells: list[str], note: str = "") -> str:
        text = label.ljust(self.LABEL_WIDTH)
        for rank, cell in enumerate(cells):
            group_end = (rank + 1) % self.tp == 0
            text += cell.ljust(self.cell + (1 if group_end else 0))
        return f"{text} {note}".rstrip() if note else text.rstrip()

    def _batch_row(self) -> str:
        width = self.cp * (self.tp * self.cell + 1)
        text = "batch".ljust(self.LABEL_WIDTH)
        # in rank order, one box per batch block (its cp x tp ranks); every pipeline stage holds each batch
        for first in range(0, self.topo.world_size, self.cp * self.tp):
            name = f"B{self.topo.ranks[first].batch}"
            inner = width - 5
            box = f"[{name.center(inner, '=')}]" if inner >= len(name) + 2 else name
            text += box.ljust(width)
        return f"{text.rstrip()}     one batch per {self._batch_unit()}"

    def _batch_unit(self) -> str:
        if self.cp == 1:
            return self._tp_unit()
        return f"cp group of {self.cp}" if self.tp == 1 else f"cp group of {self.cp} TP groups"

    def _tp_unit(self) -> str:
        return {1: "rank", 2: "TP pair"}.get(self.tp, f"TP group of {self.tp}")

    def _expert_cells(self, ep: int, num_experts: int | None) -> tuple[list[str], str]:
        cfg = self.topo.config
        try:
            alt = DistributedConfig.from_dict({**cfg.to_dict(), "ep_size": ep, "ep_plan": None})
        except ValueError as exc:
            raise ValueError(f"describe: ep_size={ep} does not fit this layout: {exc}") from None
        alt_topo = build_topology(alt)
        if num_experts is None:
            cells = [f"ep{r.ep}" for r in alt_topo.ranks]
        else:
            cells = [_expert_label(alt_topo.experts_of(r.rank, num_experts)) for r in alt_topo.ranks]
        note = f"group = {self._ep_group_words(ep)},   efsdp_size={alt.efsdp_size}"
        return cells, note

    def _ep_group_words(self, ep: int) -> str:
        if ep == self.topo.world_size:
            return "all ranks"
        if ep == self.tp:
            return f"a {self._tp_unit()}"
        count = ep // self.tp
        plural = {1: "ranks", 2: "pairs"}.get(self.tp, "TP groups")
        word = _NUMBER_WORDS[count] if count < len(_NUMBER_WORDS) else str(count)
        return f"{word} {plural}"


def _expert_label(experts: range) -> str:
    first, last = experts[0], experts[-1]
    if len(experts) == 1:
        return f"E{first}"
    if len(experts) == 2:
        return f"E{first}E{last}"
    return f"E{first}-{last}"
