"""What a rank knows: its place in the world, the layout of the loaded model, and that model's state.

Torch-side and Ray-free. The rank actor (``actors/rank.py``) calls :func:`join_world` once, then
runs rank functions (``raymoe.rank.*``) that take the returned :class:`RankContext` first. A world
outlives the models loaded on it: each load sets the layout it was resolved for
(:meth:`RankContext.use_layout`, meshes cached per shape, their process groups made once per rank set:
:mod:`raymoe.rank.groups`) and puts a :class:`LoadedModel` in ``ctx.loaded``; unloading drops it and keeps the
process groups.

Two meshes over the same ranks, named as in :mod:`raymoe.spec.topology`::

    dense  (dp_replicate, pp, fsdp, cp, tp)  ctx.mesh("tp"), ctx.mesh("cp"), ctx.mesh("fsdp"), ctx.mesh("dp_replicate"),
                                             ctx.mesh("pp"); with cp_size > 1 also fsdp and cp flattened ("fsdp_cp"),
                                             the ranks FSDP2 shards dense parameters over
    expert (dp_replicate, pp, efsdp, ep)     ctx.mesh("ep"), ctx.mesh("efsdp")

Device binding (:func:`choose_binding`, pure): gloo runs on the CPU; NCCL binds the one GPU this process sees and
refuses any other count. A rank placed without a GPU has its GPUs hidden by the driver (``actors/placement.py``), so
it never sees one. Every mesh dimension gets a process-group options object of its own
(:func:`mesh_backend_overrides`): torch writes each group's ranks, name and split source into the options it is
given. NCCL's groups wait :data:`NCCL_TIMEOUT_MARGIN_S` beyond the driver's collective timeout
(:func:`backend_timeout_s`), so the driver's hang diagnosis reads every rank before NCCL's watchdog ends the process.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch._C._distributed_c10d import FakeProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from raymoe.models.common.decoder import CausalLM
from raymoe.models.common.generation import Generation
from raymoe.parallel.sequence_shares import SequenceShares
from raymoe.rank.contract import DEFAULT_COLLECTIVE_TIMEOUT_S, Backend, Rendezvous, WorldBackend
from raymoe.rank.groups import GroupPool, axis_descs
from raymoe.rank.progress import FLIGHT_RECORDER_ENTRIES
from raymoe.spec.balance import BalanceConfig
from raymoe.spec.launch import LaunchSpec
from raymoe.spec.optimizer import OptimizerConfig
from raymoe.spec.precision import PrecisionPolicy
from raymoe.spec.topology import DENSE_AXES, EXPERT_AXES, FSDP_CP, Axis, RankCoords, Topology

if TYPE_CHECKING:
    from raymoe.rank.runner import StageRunner
    from raymoe.rank.state import PendingSave
    from raymoe.rank.weight_stream import WeightStream


@dataclass(frozen=True)
class RankLayout:
    """This rank under one resolved layout: its coordinates and the two meshes of that layout (and the sub-meshes
    cut from them, kept: cutting one reads the mesh's rank table on the host, each time)."""

    topology: Topology
    coords: RankCoords
    dense_mesh: DeviceMesh
    expert_mesh: DeviceMesh
    sub_meshes: dict[tuple[str, ...], DeviceMesh] = field(default_factory=dict, compare=False)

    def sub_mesh(self, parent: DeviceMesh, axes: tuple[str, ...]) -> DeviceMesh:
        key = (("dense",) if parent is self.dense_mesh else ("expert",)) + axes
        if key not in self.sub_meshes:
            self.sub_meshes[key] = parent[axes[0]] if len(axes) == 1 else parent[axes]
        return self.sub_meshes[key]


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
    precision: PrecisionPolicy
    training: Training | None = None
    generation: Generation | None = None  # a stream in progress (raymoe.rank.infer)
    pending_save: PendingSave | None = None  # an asynchronous save_state still writing (raymoe.rank.state)
    weight_stream: WeightStream | None = None  # hub weights streamed bucket by bucket (raymoe.rank.weight_stream)
    shares: SequenceShares = field(default_factory=SequenceShares)  # how forwards split sequences (cp, SP)

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
    backend: WorldBackend
    # the driver's; every group's timeout is backend_timeout_s of it (NCCL's with NCCL_TIMEOUT_MARGIN_S)
    collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S
    layout: RankLayout | None = None
    loaded: LoadedModel | None = None
    _checkpoint_group: dist.ProcessGroup | None = field(default=None, repr=False)
    _meshes: dict[tuple[tuple[int, ...], tuple[int, ...]], tuple[DeviceMesh, DeviceMesh]] = field(
        default_factory=dict, repr=False
    )
    _groups: GroupPool | None = field(default=None, repr=False)

    def use_layout(self, topology: Topology) -> RankLayout:
        """Make ``topology`` this rank's layout; every rank must call it (new meshes create process groups)."""
        if topology.world_size != self.world_size:
            raise ValueError(f"a layout of {topology.world_size} ranks cannot run on a world of {self.world_size}")
        key = (topology.mesh_shape(DENSE_AXES), topology.mesh_shape(EXPERT_AXES))
        if key not in self._meshes:
            self._meshes[key] = build_meshes(topology, self.device.type, self.group_pool())
        dense, expert = self._meshes[key]
        self.layout = RankLayout(topology, topology.ranks[self.rank], dense, expert)
        return self.layout

    def group_pool(self) -> GroupPool:
        """The process groups of this world's meshes, by member ranks (made on first use)."""
        if self._groups is None:
            backend, timeout_s = self.backend, self.collective_timeout_s
            self._groups = GroupPool(self.rank, backend, lambda: mesh_backend_overrides(backend, 1, timeout_s)[0][1])
        return self._groups

    def group_descs(self) -> dict[str, str]:
        """Each group's description -> the current layout's axes over its ranks, for progress reports (read from the
        actor's monitor thread: only the layout reference is read)."""
        layout = self.layout
        return axis_descs(layout.topology, self.rank) if layout is not None else {}

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
        return self._require_layout().sub_mesh(parent, (axis.value,))

    def data_parallel_mesh(self, shard_axis: Axis) -> DeviceMesh:
        """FSDP2's mesh for ``shard_axis`` (fsdp or efsdp): with ``dp_replicate`` in front for HSDP. Dense parameters
        shard over fsdp and cp together (the flattened ``fsdp_cp`` axis) when sequences are split."""
        parent = self.dense_mesh if shard_axis == Axis.FSDP else self.expert_mesh
        layout = self._require_layout()
        shard = FSDP_CP if shard_axis == Axis.FSDP and self.topology.axis_size(Axis.CP) > 1 else shard_axis.value
        if self.topology.axis_size(Axis.DP_REPLICATE) > 1:
            return layout.sub_mesh(parent, (Axis.DP_REPLICATE.value, shard))
        return layout.sub_mesh(parent, (shard,))

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


VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"  # the GPUs this process may use; Ray sets it to a rank's own GPU

# NCCL's watchdog ends the process once a collective outlives its group's timeout (TORCH_NCCL_ASYNC_ERROR_HANDLING's
# default), which the driver would only see as "actor died". The driver names a hung collective's culprits within
# actors.hang.diagnosis_deadline_s(collective_timeout_s) (the timeout, one poll, one answer wait: <= timeout + 10 s);
# NCCL's groups wait this long beyond the collective timeout, so the diagnosis comes first.
NCCL_TIMEOUT_MARGIN_S = 60.0
# How long rank 0's store waits for its own connection when it starts (join_world then gives it the world's timeout).
STORE_CONNECT_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class DeviceBinding:
    """The backend of a rank's process groups and the device its tensors live on."""

    backend: Backend
    device: torch.device


def choose_binding(rank: int, backend: Backend | None, visible_devices: str | None, device_count: int) -> DeviceBinding:
    """Pure: the binding of ``rank`` asked for ``backend`` (None: NCCL when this process sees a GPU, else gloo), given
    ``visible_devices`` (the process's ``CUDA_VISIBLE_DEVICES``, None when unset) and ``device_count``
    (``torch.cuda.device_count()``).

    gloo -> the CPU. NCCL -> ``cuda:0``, the one GPU of this process; any other count is a RuntimeError naming the
    rank, ``CUDA_VISIBLE_DEVICES`` and the count, since binding ``cuda:0`` there would put several ranks on one GPU
    (or none on a GPU at all).
    """
    chosen: Backend = backend if backend is not None else ("nccl" if device_count > 0 else "gloo")
    if chosen == "gloo":
        return DeviceBinding("gloo", torch.device("cpu"))
    if device_count != 1:
        shown = "unset" if visible_devices is None else repr(visible_devices)
        raise RuntimeError(
            f"rank {rank}: backend 'nccl' needs exactly one visible GPU per rank, this process sees {device_count} "
            f"(torch.cuda.device_count() = {device_count}, {VISIBLE_DEVICES} {shown}); place ranks with use_gpu=True "
            f"(Ray then shows each its own GPU; do not set RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES), or use "
            "backend='gloo'"
        )
    return DeviceBinding("nccl", torch.device("cuda", 0))


def backend_timeout_s(backend: WorldBackend, collective_timeout_s: float) -> float:
    """The process-group timeout of ``backend`` for the driver's ``collective_timeout_s``, in seconds.

    gloo raises in the rank at the timeout and the rank reports where it waited, so its groups keep
    ``collective_timeout_s``; NCCL's watchdog ends the process instead, so its groups wait
    :data:`NCCL_TIMEOUT_MARGIN_S` longer and the driver's hang diagnosis comes first.
    """
    return collective_timeout_s + NCCL_TIMEOUT_MARGIN_S if backend == "nccl" else collective_timeout_s


def host_world_store(address: str, world_size: int) -> dist.TCPStore:
    """Rank 0's part of the rendezvous, before the others are told where to meet: the world's key-value store,
    listening on a port the OS picks as it binds (``.port``), for :func:`join_world`.

    A port found free and bound later is free only until then: any connection made on the node in between may take
    it as its local end, and the world fails to start. Bound at once, it cannot be taken.
    """
    return dist.TCPStore(
        address, 0, world_size, is_master=True, timeout=timedelta(seconds=STORE_CONNECT_TIMEOUT_S),
        wait_for_workers=False,
    )  # fmt: skip


def join_world(rendezvous: Rendezvous, store: dist.Store | None = None) -> RankContext:
    """Set the torch.distributed environment, bind the device and init the process group on the world's store:
    rank 0 passes the one it hosts (:func:`host_world_store`), every other rank connects to
    ``master_addr:master_port``."""
    if (store is not None) != (rendezvous.rank == 0):
        raise ValueError(
            f"rank {rendezvous.rank}: rank 0 joins with the store it hosts (host_world_store), every other rank "
            f"without one; got {'a' if store is not None else 'no'} store"
        )
    # torch's flight recorders (the generic one and NCCL's): the collectives each group entered and finished, read
    # by raymoe.rank.progress
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", FLIGHT_RECORDER_ENTRIES)
    os.environ.update(
        RANK=str(rendezvous.rank),
        WORLD_SIZE=str(rendezvous.world_size),
        LOCAL_RANK=str(rendezvous.local_rank),
        MASTER_ADDR=rendezvous.master_addr,
        MASTER_PORT=str(rendezvous.master_port),
    )
    binding = choose_binding(
        rendezvous.rank, rendezvous.backend, os.environ.get(VISIBLE_DEVICES), torch.cuda.device_count()
    )
    if binding.device.type == "cuda":
        torch.cuda.set_device(binding.device)
    timeout = timedelta(seconds=backend_timeout_s(binding.backend, rendezvous.collective_timeout_s))
    if store is None:
        store = dist.TCPStore(
            rendezvous.master_addr, rendezvous.master_port, rendezvous.world_size, is_master=False, timeout=timeout
        )
    store.set_timeout(timeout)
    dist.init_process_group(
        backend=binding.backend,
        store=store,
        rank=rendezvous.rank,
        world_size=rendezvous.world_size,
        timeout=timeout,
        device_id=binding.device if binding.device.type == "cuda" else None,
    )
    return RankContext(
        rendezvous.rank, rendezvous.world_size, binding.device, binding.backend, rendezvous.collective_timeout_s
    )


def use_layout(ctx: RankContext, topology: Topology) -> None:
    """Rank function: switch this rank to ``topology`` (drops any loaded model first)."""
    ctx.loaded = None
    ctx.use_layout(topology)


def build_meshes(topology: Topology, device_type: str, groups: GroupPool) -> tuple[DeviceMesh, DeviceMesh]:
    """The dense and expert DeviceMeshes; every rank must call this (it may create process groups).

    Each mesh dimension takes the group of its rank set from ``groups``, made once per world with the world's
    collective timeout (NCCL's with its margin, :func:`backend_timeout_s`): left to torch, a group would wait 30
    minutes in a collective a rank never reaches. The flattened ``fsdp_cp`` group is made by torch, with the same
    timeout, once per cp layout shape (the meshes are cached per shape).
    """
    dense = _pooled_mesh(topology, DENSE_AXES, device_type, groups)
    if topology.axis_size(Axis.CP) > 1:  # FSDP2's dense shard group: fsdp and cp, adjacent in the dense view
        dense[Axis.FSDP.value, Axis.CP.value]._flatten(FSDP_CP, backend_override=(groups.backend, groups.new_options()))
    return dense, _pooled_mesh(topology, EXPERT_AXES, device_type, groups)


def _pooled_mesh(topology: Topology, axes: tuple[Axis, ...], device_type: str, groups: GroupPool) -> DeviceMesh:
    """The mesh of ``topology``'s view over ``axes``, each dimension on the pooled group of its rank set."""
    grid = torch.arange(topology.world_size).reshape(topology.mesh_shape(axes))
    return DeviceMesh.from_group(
        groups.groups_of(grid), device_type, mesh=grid, mesh_dim_names=tuple(axis.value for axis in axes)
    )


def mesh_backend_overrides(
    backend: WorldBackend, dims: int, collective_timeout_s: float, new_options: Callable[[], Any] | None = None
) -> tuple[tuple[str, Any], ...]:
    """One ``(backend, options)`` per mesh dimension, each options object made afresh by ``new_options`` (default:
    the backend's options type) and carrying :func:`backend_timeout_s`.

    Never one object for several dimensions: torch writes each new group's ranks, name and (under NCCL) split source
    and colour into the options it is given (``_new_process_group_helper``, ``split_group``) and the group keeps a
    reference to them. gloo reads only ``_timeout`` (DeviceMesh passes it on; without an options object its groups
    would get torch's 30-minute default).
    """
    make = new_options if new_options is not None else _options_type(backend)
    timeout = timedelta(seconds=backend_timeout_s(backend, collective_timeout_s))
    overrides = []
    for _ in range(dims):
        options = make()
        options._timeout = timeout
        overrides.append((backend, options))
    return tuple(overrides)


def _options_type(backend: WorldBackend) -> Callable[[], Any]:
    if backend == "nccl":
        return dist.ProcessGroupNCCL.Options
    if backend == "fake":
        return FakeProcessGroup.Options  # type: ignore[return-value]
    return dist.ProcessGroupGloo._Options  # type: ignore[attr-defined,no-any-return]


def group_timeout_s(group: dist.ProcessGroup, device: torch.device) -> float:
    """The collective timeout a process group was created with, in seconds (for checks and diagnostics)."""
    timeout: timedelta = group._get_backend(device).options._timeout
    return timeout.total_seconds()


def leave_world() -> None:
    """Leave the process group; safe to call twice."""
    if dist.is_initialized():
        dist.destroy_process_group()
