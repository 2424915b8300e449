"""One rank's distributed state: process group, device and the named DeviceMeshes (SPEC RAY-2).

Torch-side and Ray-free: the rank actor (``actors/rank.py``) calls :func:`init_rank` once and
then runs raymoe functions that take the returned :class:`RankContext` as first argument.

Two meshes over the same ranks, named as in :mod:`raymoe.topology`::

    dense  (dp_replicate, fsdp,  tp)     ctx.mesh("tp"), ctx.mesh("fsdp"), ctx.mesh("dp_replicate")
    expert (dp_replicate, efsdp, ep)     ctx.mesh("ep"), ctx.mesh("efsdp")
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from raymoe.config import DistributedConfig
from raymoe.topology import DENSE_AXES, EXPERT_AXES, Axis, RankCoords, Topology, build_topology

Backend = Literal["nccl", "gloo"]


@dataclass(frozen=True)
class RankSpec:
    """Everything a rank needs to join the world; built on the driver, sent to each actor."""

    rank: int
    local_rank: int
    world_size: int
    master_addr: str
    master_port: int
    config: dict[str, Any]
    backend: Backend | None = None
    collective_timeout_s: float = 1800.0


@dataclass
class RankContext:
    """A rank's view of the world. ``state`` holds what later calls put there (model, optimizer)."""

    topology: Topology
    coords: RankCoords
    device: torch.device
    backend: str
    dense_mesh: DeviceMesh
    expert_mesh: DeviceMesh
    state: dict[str, Any] = field(default_factory=dict)

    @property
    def rank(self) -> int:
        return self.coords.rank

    def mesh(self, axis: Axis | str) -> DeviceMesh:
        """The 1-D sub-mesh of ``axis`` that contains this rank."""
        axis = Axis(axis)
        parent = self.dense_mesh if axis in DENSE_AXES else self.expert_mesh
        return parent[axis.value]


def default_backend() -> Backend:
    """NCCL where this process sees a GPU, gloo otherwise."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_rank(spec: RankSpec) -> RankContext:
    """Set the torch.distributed environment, bind the device, init the process group, build meshes."""
    os.environ.update(
        RANK=str(spec.rank),
        WORLD_SIZE=str(spec.world_size),
        LOCAL_RANK=str(spec.local_rank),
        MASTER_ADDR=spec.master_addr,
        MASTER_PORT=str(spec.master_port),
    )
    backend = spec.backend or default_backend()
    device = _bind_device(backend)
    dist.init_process_group(
        backend=backend,
        rank=spec.rank,
        world_size=spec.world_size,
        timeout=timedelta(seconds=spec.collective_timeout_s),
        device_id=device if device.type == "cuda" else None,
    )
    topology = build_topology(DistributedConfig.from_dict(spec.config), spec.world_size)
    dense, expert = build_meshes(topology, device.type)
    return RankContext(topology, topology.ranks[spec.rank], device, backend, dense, expert)


def _bind_device(backend: str) -> torch.device:
    if backend != "nccl":
        return torch.device("cpu")
    # Ray exposes only this actor's GPU through CUDA_VISIBLE_DEVICES, so it is always index 0.
    torch.cuda.set_device(0)
    return torch.device("cuda", 0)


def build_meshes(topology: Topology, device_type: str) -> tuple[DeviceMesh, DeviceMesh]:
    """The dense and expert DeviceMeshes; every rank must call this (it creates process groups)."""
    ranks = torch.arange(topology.world_size)
    dense = DeviceMesh(
        device_type,
        ranks.reshape(topology.mesh_shape(DENSE_AXES)),
        mesh_dim_names=tuple(axis.value for axis in DENSE_AXES),
    )
    expert = DeviceMesh(
        device_type,
        ranks.reshape(topology.mesh_shape(EXPERT_AXES)),
        mesh_dim_names=tuple(axis.value for axis in EXPERT_AXES),
    )
    return dense, expert


def shutdown_rank() -> None:
    """Leave the process group; safe to call twice."""
    if dist.is_initialized():
        dist.destroy_process_group()
