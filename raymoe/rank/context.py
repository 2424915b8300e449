"""What a rank knows: its place in the world, the layout of the loaded model, and that model's state.

Torch-side and Ray-free. The rank actor (``actors/rank.py``) calls :func:`join_world` once, then
runs rank functions (``raymoe.rank.*``) that take the returned :class:`RankContext` first. A world
outlives the models loaded on it: each load sets the layout it was resolved for
(:meth:`RankContext.use_layout`, meshes cached per shape) and puts a :class:`LoadedModel` in
``ctx.loaded``; unloading drops it and keeps the process group.

Two meshes over the same ranks, named as in :mod:`raymoe.spec.topology`::

    dense  (dp_replicate, pp, fsdp,  tp)     ctx.mesh("tp"), ctx.mesh("fsdp"), ctx.mesh("dp_replicate"), ctx.mesh("pp")
    expert (dp_replicate, pp, efsdp, ep)     ctx.mesh("ep"), ctx.mesh("efsdp")
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from raymoe.models.common.decoder import CausalLM
from raymoe.models.common.generation import Generation
from raymoe.rank.contract import DEFAULT_COLLECTIVE_TIMEOUT_S, Backend, Rendezvous
from raymoe.rank.progress import FLIGHT_RECORDER_ENTRIES
from raymoe.spec.balance import BalanceConfig
from raymoe.spec.launch import LaunchSpec
from raymoe.spec.optimizer import OptimizerConfig
from raymoe.spec.topology import DENSE_AXES, EXPERT_AXES, Axis, RankCoords, Topology

if TYPE_CHECKING:
    from raymoe.rank.runner import StageRunner
    from raymoe.rank.state import PendingSave


@dataclass(frozen=True)
class RankLayout:
    """This rank under one resolved layout: its coordinates and the two meshes of that layout."""

    topology: Topology
    coords: RankCoords
    dense_mesh: DeviceMesh
    expert_mesh: DeviceMesh


@dataclass
class Training:
    """The optimizer of a loaded model, the configuration it was built from, and the load-balancing settings."""

    optimizer: torch.optim.Optimizer
    config: OptimizerConfig
    balance: BalanceConfig


@dataclass
class LoadedModel:
    """The model this rank holds a shard of, the launch spec it was loaded from, and its training state.

    ``runner`` holds the parts: the whole model (one part), or under pipeline parallelism the parts of the
    stages this rank runs (``spec.stages.stages_of(pp)``, in order; several with an interleaved schedule).
    """

    runner: StageRunner
    spec: LaunchSpec
    training: Training | None = None
    generation: Generation | None = None  # a stream in progress (raymoe.rank.infer)
    pending_save: PendingSave | None = None  # an asynchronous save_state still writing (raymoe.rank.state)

    @property
    def parts(self) -> tuple[CausalLM, ...]:
        return self.runner.parts

    @property
    def stage_ids(self) -> tuple[int, ...]:
        """The pipeline stage of each part."""
        return self.runner.stage_ids

    @property
    def model(self) -> CausalLM:
        """The whole model; an error under pipeline parallelism, where a rank holds only its stages' ``parts``."""
        return self.runner.whole_model()

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """Every parameter this rank holds a shard of, by its name in the whole model."""
        return [item for part in self.parts for item in part.named_parameters()]

    def require_training(self) -> Training:
        if self.training is None:
            raise RuntimeError("train_step before configure_training: no optimizer on this rank")
        return self.training


@dataclass
class RankContext:
    """A rank's view of the world; ``layout`` and ``loaded`` change as models are loaded and unloaded."""

    rank: int
    world_size: int
    device: torch.device
    backend: str
    collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S  # of the world group and of every sub-mesh group
    layout: RankLayout | None = None
    loaded: LoadedModel | None = None
    _checkpoint_group: dist.ProcessGroup | None = field(default=None, repr=False)
    _meshes: dict[tuple[tuple[int, ...], tuple[int, ...]], tuple[DeviceMesh, DeviceMesh]] = field(
        default_factory=dict, repr=False
    )

    def use_layout(self, topology: Topology) -> RankLayout:
        """Make ``topology`` this rank's layout; every rank must call it (new meshes create process groups)."""
        if topology.world_size != self.world_size:
            raise ValueError(f"a layout of {topology.world_size} ranks cannot run on a world of {self.world_size}")
        key = (topology.mesh_shape(DENSE_AXES), topology.mesh_shape(EXPERT_AXES))
        if key not in self._meshes:
            self._meshes[key] = build_meshes(topology, self.device.type, self.backend, self.collective_timeout_s)
        dense, expert = self._meshes[key]
        self.layout = RankLayout(topology, topology.ranks[self.rank], dense, expert)
        return self.layout

    def _require_layout(self) -> RankLayout:
        if self.layout is None:
            raise RuntimeError("this rank has no layout yet: load a model first")
        return self.layout

    @property
    def topology(self) -> Topology:
        return self._require_layout().topology

    @property
    def coords(self) -> RankCoords:
        return self._require_layout().coords

    @property
    def dense_mesh(self) -> DeviceMesh:
        return self._require_layout().dense_mesh

    @property
    def expert_mesh(self) -> DeviceMesh:
        return self._require_layout().expert_mesh

    def mesh(self, axis: Axis | str) -> DeviceMesh:
        """The 1-D sub-mesh of ``axis`` that contains this rank."""
        axis = Axis(axis)
        parent = self.dense_mesh if axis in DENSE_AXES else self.expert_mesh
        return parent[axis.value]

    def data_parallel_mesh(self, shard_axis: Axis) -> DeviceMesh:
        """FSDP2's mesh for ``shard_axis`` (fsdp or efsdp): with ``dp_replicate`` in front for HSDP."""
        parent = self.dense_mesh if shard_axis == Axis.FSDP else self.expert_mesh
        if self.topology.axis_size(Axis.DP_REPLICATE) > 1:
            return parent[(Axis.DP_REPLICATE.value, shard_axis.value)]
        return parent[shard_axis.value]

    @property
    def answers_for_batch(self) -> bool:
        """True on the first rank of each tp group of the last pipeline stage: it returns the results of its
        batch rows (TOPO-1)."""
        return self.topology.answers(self.rank)

    def require_model(self) -> LoadedModel:
        if self.loaded is None:
            raise RuntimeError("no model is loaded on this rank")
        return self.loaded

    def checkpoint_group(self) -> dist.ProcessGroup:
        """A gloo group over the whole world for DCP's collectives, made on first use (every rank must call it then):
        an asynchronous save runs them in a thread, which must not share a group with the training step."""
        if self._checkpoint_group is None:
            self._checkpoint_group = dist.new_group(
                backend="gloo", timeout=timedelta(seconds=self.collective_timeout_s)
            )
        return self._checkpoint_group


def default_backend() -> Backend:
    """NCCL where this process sees a GPU, gloo otherwise."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def join_world(rendezvous: Rendezvous) -> RankContext:
    """Set the torch.distributed environment, bind the device and init the process group."""
    # torch's flight recorder: the collectives each group entered and finished, read by raymoe.rank.progress
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", FLIGHT_RECORDER_ENTRIES)
    os.environ.update(
        RANK=str(rendezvous.rank),
        WORLD_SIZE=str(rendezvous.world_size),
        LOCAL_RANK=str(rendezvous.local_rank),
        MASTER_ADDR=rendezvous.master_addr,
        MASTER_PORT=str(rendezvous.master_port),
    )
    backend = rendezvous.backend or default_backend()
    device = _bind_device(backend)
    dist.init_process_group(
        backend=backend,
        rank=rendezvous.rank,
        world_size=rendezvous.world_size,
        timeout=timedelta(seconds=rendezvous.collective_timeout_s),
        device_id=device if device.type == "cuda" else None,
    )
    return RankContext(rendezvous.rank, rendezvous.world_size, device, backend, rendezvous.collective_timeout_s)


def use_layout(ctx: RankContext, topology: Topology) -> None:
    """Rank function: switch this rank to ``topology`` (drops any loaded model first)."""
    ctx.loaded = None
    ctx.use_layout(topology)


def _bind_device(backend: str) -> torch.device:
    if backend != "nccl":
        return torch.device("cpu")
    # Ray exposes only this actor's GPU through CUDA_VISIBLE_DEVICES, so it is always index 0.
    torch.cuda.set_device(0)
    return torch.device("cuda", 0)


def build_meshes(topology: Topology, device_type: str, backend: str, timeout_s: float) -> tuple[DeviceMesh, DeviceMesh]:
    """The dense and expert DeviceMeshes; every rank must call this (it creates process groups).

    Every sub-mesh group (tp, fsdp, ep, efsdp, dp_replicate) gets the world's collective timeout: left to
    torch, they would wait 30 minutes in a collective a rank never reaches.
    """
    ranks = torch.arange(topology.world_size)
    override = _backend_with_timeout(backend, timeout_s)
    dense = DeviceMesh(
        device_type,
        ranks.reshape(topology.mesh_shape(DENSE_AXES)),
        mesh_dim_names=tuple(axis.value for axis in DENSE_AXES),
        backend_override=(override,) * len(DENSE_AXES),
    )
    expert = DeviceMesh(
        device_type,
        ranks.reshape(topology.mesh_shape(EXPERT_AXES)),
        mesh_dim_names=tuple(axis.value for axis in EXPERT_AXES),
        backend_override=(override,) * len(EXPERT_AXES),
    )
    return dense, expert


def _backend_with_timeout(backend: str, timeout_s: float) -> tuple[str, Any]:
    """``(backend, options)`` for a mesh dim: the backend's process-group options carrying ``timeout_s``."""
    options = dist.ProcessGroupNCCL.Options() if backend == "nccl" else dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._timeout = timedelta(seconds=timeout_s)
    return backend, options


def group_timeout_s(group: dist.ProcessGroup, device: torch.device) -> float:
    """The collective timeout a process group was created with, in seconds (for checks and diagnostics)."""
    timeout: timedelta = group._get_backend(device).options._timeout
    return timeout.total_seconds()


def leave_world() -> None:
    """Leave the process group; safe to call twice."""
    if dist.is_initialized():
        dist.destroy_process_group()
