"""DCP planners that save and load DTensors whose local shard is several boxes of the global tensor.

``torch.distributed.checkpoint`` describes each rank's shard of a DTensor by one offset and one size,
which holds for ``Shard`` placements but not for a packed weight under ``_StridedShard`` (the tensor-parallel
split of ``gate_up_proj`` = [gate; up], :mod:`raymoe.parallel.sharding`): its local tensor concatenates
one chunk of *each* packed piece. DCP's default planners describe such a shard as one contiguous block at the
first piece's offset, so the ranks' blocks overlap and the save fails its plan validation::

    global dim d   | g0 g1 | g2 g3 | u0 u1 | u2 u3 |      rank 1 of tp 2 holds [g2 g3 u2 u3]
    DCP default    one chunk at offset 2, size 4  ->  claims | g2 g3 u0 u1 |  (overlaps rank 0's: refused)
    these planners two chunks: offset 2 size 2 (local 0:2), offset 6 size 2 (local 2:4)

These planners describe such a shard as the boxes :func:`~raymoe.parallel.sharding.shard_layout` gives (one
per combination of index ranges), each a view of the local tensor, and leave every other entry to DCP. The
saved tensor is the global one, so a state saved under one layout loads under any other (DCP reshards
box by box).
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.tensor import DTensor

from raymoe.parallel.sharding import shard_layout


@dataclass(frozen=True)
class Box:
    """One contiguous block of a rank's shard: where it lies in the global tensor and in the local one."""

    global_offsets: tuple[int, ...]
    local_offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def chunk(self) -> ChunkStorageMetadata:
        return ChunkStorageMetadata(offsets=torch.Size(self.global_offsets), sizes=torch.Size(self.sizes))

    def view(self, local: Tensor) -> Tensor:
        """The block of ``local`` this box covers (a view: DCP reads into it in place)."""
        for dim, (start, size) in enumerate(zip(self.local_offsets, self.sizes, strict=True)):
            local = local.narrow(dim, start, size)
        return local


def boxes_of(tensor: Tensor) -> list[Box] | None:
    """The boxes of this rank's shard of ``tensor`` when it is more than one (a strided DTensor), else None."""
    if not isinstance(tensor, DTensor) or tensor.device_mesh.get_coordinate() is None:
        return None
    layout = shard_layout(tensor)
    if all(len(ranges) <= 1 for ranges in layout.ranges):
        return None
    per_dim = []
    for ranges in layout.ranges:
        starts = list(itertools.accumulate((len(r) for r in ranges), initial=0))
        per_dim.append([(r.start, start, len(r)) for r, start in zip(ranges, starts, strict=False)])
    return [
        Box(tuple(g for g, _, _ in cell), tuple(loc for _, loc, _ in cell), tuple(n for _, _, n in cell))
        for cell in itertools.product(*per_dim)
    ]


def _boxed_entries(state_dict: dict[str, Any]) -> dict[str, list[Box]]:
    return {fqn: boxes for fqn, value in state_dict.items() if (boxes := boxes_of(value)) is not None}


def _box_at(boxes: list[Box], offsets: torch.Size | None, fqn: str) -> Box:
    for box in boxes:
        if offsets is not None and tuple(offsets) == box.global_offsets:
            return box
    raise ValueError(f"{fqn}: this rank holds no box at global offset {offsets}")


class BoxSavePlanner(DefaultSavePlanner):
    """:class:`DefaultSavePlanner` that writes each box of a strided shard as its own chunk."""

    def set_up_planner(self, state_dict: Any, storage_meta: Any = None, is_coordinator: bool = False) -> None:
        super().set_up_planner(state_dict, storage_meta, is_coordinator)
        self._boxes = _boxed_entries(self.state_dict)

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        items = [item for item in plan.items if item.index.fqn not in self._boxes]
        for fqn, boxes in self._boxes.items():
            tensor = self.state_dict[fqn]
            properties = TensorProperties.create_from_tensor(tensor.to_local())
            items += [
                WriteItem(
                    index=MetadataIndex(fqn, torch.Size(box.global_offsets)),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(chunk=box.chunk, properties=properties, size=tensor.size()),
                )
                for box in boxes
            ]
        self.plan = dataclasses.replace(plan, items=items)
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        boxes = self._boxes.get(index.fqn)
        if boxes is None:
            return super().lookup_object(index)
        # a contiguous copy of the block: the writer serialises it as one tensor
        return _box_at(boxes, index.offset, index.fqn).view(self.state_dict[index.fqn].to_local()).contiguous()


class BoxLoadPlanner(DefaultLoadPlanner):
    """:class:`DefaultLoadPlanner` that reads into each box of a strided shard separately (any saved layout)."""

    def set_up_planner(self, state_dict: Any, metadata: Any = None, is_coordinator: bool = False) -> None:
        super().set_up_planner(state_dict, metadata, is_coordinator)
        self._boxes = _boxed_entries(self.state_dict)

    def create_local_plan(self) -> LoadPlan:
        plan = super().create_local_plan()
        assert self.metadata is not None  # set by set_up_planner
        items = [item for item in plan.items if item.dest_index.fqn not in self._boxes]
        for fqn, boxes in self._boxes.items():
            saved = self.metadata.state_dict_metadata[fqn]
            assert isinstance(saved, TensorStorageMetadata)  # the default plan above checked shape and kind
            items += create_read_items_for_chunk_list(fqn, saved, [box.chunk for box in boxes])
        return dataclasses.replace(plan, items=items)

    def lookup_tensor(self, index: MetadataIndex) -> Tensor:
        boxes = self._boxes.get(index.fqn)
        if boxes is None:
            return super().lookup_tensor(index)
        return _box_at(boxes, index.offset, index.fqn).view(self.state_dict[index.fqn].to_local())
