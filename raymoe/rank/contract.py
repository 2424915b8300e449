"""The driver <-> rank contract: every message that crosses between the driver and a rank process.

Plain frozen data, pickled by Ray (or passed as is by an in-process group). The driver builds the requests
and reads the answers; it imports this module, and the rank functions it sends, but no rank internals.

    driver -> rank                                   rank -> driver
    Rendezvous      join the world (once)            RankFailure   a rank function raised (as text + its kind)
    MicroBatch      rows of a step or evaluation     LoadReport    bytes read / held after load_shards
    DecodeRequest   how to decode (generation)       StepResult    a rank's share of one optimizer step
    StateRequest    where a training state goes      SaveResult    save_pretrained's files or failure (rank 0)
                                                     StateAnswer   a state save / wait / load outcome
                                                     RankProgress  what a rank runs, where it waits (monitor)

Shapes use ``B`` (rows of this rank), ``S`` (sequence), ``L`` (MoE layers), ``E`` (experts), ``M``
(micro-batches). Tensors travel on CPU; the rank moves them to its device.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Literal

from torch import Tensor

from raymoe.models.common.generation import SamplingConfig, StopRules
from raymoe.spec.precision import PrecisionPolicy

Backend = Literal["nccl", "gloo"]
# A world's backend: a user's (nccl, gloo), or torch's "fake" one, whose collectives do nothing: the worlds of one
# rank each that raymoe.plan shards a meta model in, to count what every rank of a layout would hold.
WorldBackend = Literal["nccl", "gloo", "fake"]

# A collective that waits longer than this ends the call (SPEC RAY-2): long enough for a slow step or shard read,
# short enough that a hung rank is named within minutes (actors/group.py watches for it on the driver).
DEFAULT_COLLECTIVE_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Rendezvous:
    """Everything a rank needs to join the world; built on the driver, sent to each rank once."""

    rank: int
    local_rank: int
    world_size: int
    master_addr: str
    master_port: int  # of the store rank 0 already hosts (rank.context.host_world_store): bound before it is told
    backend: Backend | None = None
    collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch of a rank's rows: ``input_ids`` and ``labels`` ``[B, S]`` int64 (-100: no loss),
    ``token_mask [B, S]`` bool, the real tokens (False: padding), which the aux loss counts, and for packed rows
    ``document_ids [B, S]`` (each document attends only to itself; None: plain rows). Every rank of a tp group
    gets the same rows (TOPO-1). A policy loss (RL) adds ``fields``: per-token ``[B, S]`` float32 inputs
    (``weights``, ``advantages``, ``old_logprobs``, ``ref_logprobs``: :mod:`raymoe.rank.objective`); router
    replay adds ``routes [B, S, L_moe, K]`` int16, the expert ids every sparse layer uses."""

    input_ids: Tensor
    labels: Tensor
    token_mask: Tensor
    document_ids: Tensor | None = None
    fields: dict[str, Tensor] | None = None
    routes: Tensor | None = None


@dataclass(frozen=True)
class BlockRows:
    """A data-parallel batch's rows of a global batch whose rows stay in Ray's object store (``StreamedData``):
    row ``i`` is row ``rows[i]`` of block ``blocks[i]``, a position among the blocks sent with the call (-1: an
    all-padding row that adds no token), cut into ``micro_batches`` consecutive micro-batches. A block holds
    ``input_ids``, ``labels`` (the targets), ``token_mask`` and, for document packing, ``document_ids``, each
    ``[R, S]`` (``raymoe.driver.data_operators.BlockOperator``)."""

    blocks: Any  # np.ndarray [B] int32
    rows: Any  # np.ndarray [B] int32
    micro_batches: int = 1

    @property
    def num_rows(self) -> int:
        return len(self.rows)


@dataclass(frozen=True)
class StepResult:
    """One rank's share of a step: its summed token loss, the global gradient norm before clipping (the same on
    every rank), and (the answering rank of a batch, MoE models) of its rows: pairs per expert ``[L, E]``, dropped
    pairs ``[L]`` and each micro-batch's aux-loss statistics ``[M, 2 L E + 1]`` (chosen pairs of real tokens and
    summed router probabilities per layer, real tokens), from which the driver reports the aux loss whether or not
    it is trained on."""

    loss_sum: float
    grad_norm: float
    expert_load: Tensor | None = None
    dropped_pairs: Tensor | None = None
    aux_stats: Tensor | None = None
    policy_stats: tuple[float, ...] | None = None  # a policy loss's sums (raymoe.rank.objective), answering rank
    compile_s: float = 0.0  # seconds this rank spent compiling decoder blocks in the step (a new shape's first)


@dataclass(frozen=True)
class EvalResult:
    """One rank's share of an evaluation: its summed token loss, and the seconds it spent compiling decoder blocks
    for it (a forward without gradients of a new shape compiles graphs of its own)."""

    loss_sum: float
    compile_s: float = 0.0


@dataclass(frozen=True)
class DecodeRequest:
    """What every rank needs to decode its rows, checked on the driver."""

    max_new_tokens: int
    sampling: SamplingConfig
    stop: StopRules
    keep_routes: bool = False  # router replay: also answer every token's experts [B, S + n, L_moe, K]


@dataclass(frozen=True)
class LogprobRequest:
    """How :func:`raymoe.rank.logprobs.token_logprobs` answers: at ``temperature``, with the per-token entropy, and
    with the routes of the ``num_slots`` sparse layers."""

    temperature: float = 1.0
    return_entropy: bool = False
    return_routes: bool = False
    num_slots: int = 0


@dataclass(frozen=True)
class LoadReport:
    """What one rank read: bytes requested from the checkpoint, the bytes of its local parameters, and the
    precision policy it resolved from the checkpoint's dtype (the same on every rank)."""

    rank: int
    bytes_read: int
    bytes_held: int
    precision: PrecisionPolicy
    trainable_params: int = 0  # local elements of parameters that take gradients (all, or the LoRA factors)
    trainable_bytes: int = 0
    frozen_params: int = 0  # local elements of the others (a LoRA model's base)
    # whether every FSDP2 unit keeps its gathered weights until backward (raymoe.spec.reshard); None: no FSDP2
    keeps_gathered: bool | None = None


@dataclass(frozen=True)
class RankMemory:
    """What one rank holds of a model, in bytes of its local shards: ``parameters`` (every parameter, trainable or
    frozen; MXFP4 experts kept packed count their packed bytes), ``gradients`` (one per trainable parameter, shaped
    and typed like its shard: what a step holds between backward and the optimizer step), ``optimizer`` (fused
    AdamW's two moments per trainable shard, in its dtype, and one float32 step each). Planned on meta
    (:func:`raymoe.rank.footprint.planned_memory`) or measured on a loaded rank
    (:func:`~raymoe.rank.footprint.held_memory`: gradients and optimizer states as they exist then, 0 where none do).
    """

    rank: int
    parameters: int
    gradients: int
    optimizer: int
    trainable: int = 0  # bytes of the parameters that train: what a step's gradients take
    parameter_elements: int = 0  # local elements of every parameter (what FSDP2 gathers, what TP / EP split)
    trainable_elements: int = 0  # local elements of the parameters that train (all, or the LoRA factors)

    @property
    def states(self) -> int:
        """Parameters, gradients and optimizer states together: what a rank holds at the step's optimizer update."""
        return self.parameters + self.gradients + self.optimizer


@dataclass(frozen=True)
class PlannedRank:
    """A rank of a planned layout (``raymoe.plan``): what it will hold (exact), and what FSDP2 gathers of its largest
    decoder layer (``layer_gathered``: the unsharded weights in the dtype they compute in; ``layer_gradients``: their
    unsharded gradients before the reduce-scatter, in the reduce dtype; both 0 where FSDP2 does not wrap) and of every
    unit (``gathered``: what keeping every unit's gathered weights holds, :mod:`raymoe.spec.reshard`)."""

    memory: RankMemory
    layer_gathered: int = 0
    layer_gradients: int = 0
    gathered: int = 0


@dataclass(frozen=True)
class SaveResult:
    """One rank's answer to ``save_gathered``: rank 0's files, or why it saved nothing (``error``, a message
    naming the file and the cause; ``errno``, the disk's code when it gave one). Other ranks answer an empty one."""

    files: tuple[str, ...] = ()
    error: str | None = None
    errno: int | None = None


@dataclass(frozen=True)
class AdapterTensors:
    """One rank's answer to ``gather_adapters``: the full LoRA factors (CPU, by raymoe path) of the stage it answers
    for (the first rank of each pipeline stage), empty on the others."""

    tensors: dict[str, Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class PushAnswer:
    """Rank 0's answer to ``push_hub_weights``: buckets, tensors and bytes sent (to each receiver), and ``error``, the
    first receiver failure as a sentence (None: every receiver applied every bucket)."""

    buckets: int = 0
    tensors: int = 0
    bytes: int = 0
    error: str | None = None


@dataclass(frozen=True)
class StateRequest:
    """Where a save writes (``staging``, beside ``target``) and the manifest rank 0 adds (JSON-ready)."""

    staging: str
    target: str
    manifest: dict[str, Any]
    async_save: bool = False


@dataclass(frozen=True)
class StateAnswer:
    """One rank's answer to a save, wait or load: ``error`` (naming file and cause) or None, ``errno`` where the disk
    gave one, seconds from the call (or the asynchronous save's start) to the answer, and bytes this rank wrote."""

    error: str | None = None
    errno: int | None = None
    seconds: float = 0.0
    bytes_written: int = 0


MESH_PREFIX = "mesh_"  # a group named by its axes: by DeviceMesh (``mesh_fsdp_cp``), by progress reports (``mesh_tp``)
RANK_SET_DESC = "ranks_"
"""How a layout's process group is described (``ranks_0_2``: its member ranks; :mod:`raymoe.rank.groups`). A rank's
progress report names it by the axes of its current layout over those ranks (``mesh_fsdp``, ``mesh_tp/ep``)."""
WORLD_GROUP_DESC = "default_pg"  # how torch describes the default group, which is a layout's group over every rank


def rank_set_desc(members: tuple[int, ...]) -> str:
    return RANK_SET_DESC + "_".join(map(str, members))


def rank_set_of(desc: str) -> tuple[int, ...] | None:
    """The member ranks a group description names (None: not a rank-set description)."""
    digits = desc.removeprefix(RANK_SET_DESC).split("_")
    if not desc.startswith(RANK_SET_DESC) or not all(d.isdigit() for d in digits):
        return None
    return tuple(int(d) for d in digits)


@dataclass(frozen=True)
class GroupProgress:
    """One process group on one rank: ``name`` (the same on every member), ``desc`` (``mesh_tp``, ``mesh_tp/ep``,
    ``mesh_fsdp_cp``, ``default_pg``, ``ranks_0_3`` ...), collectives entered and finished, and the last one entered
    (``op``, e.g. ``all_reduce``)."""

    name: str
    desc: str
    entered: int
    finished: int
    op: str = ""
    waiting_s: float = 0.0  # how long the last entered collective has been in flight (0 when finished)

    @property
    def waiting(self) -> bool:
        return self.entered > self.finished


@dataclass(frozen=True)
class RankProgress:
    """A rank's answer: its rank, the rank function it runs (None between calls), for how long, and its groups."""

    rank: int
    function: str | None
    running_s: float
    groups: tuple[GroupProgress, ...] = field(default_factory=tuple)

    def waiting_in(self) -> list[GroupProgress]:
        return [group for group in self.groups if group.waiting]


class FailureKind(enum.Enum):
    """Why a rank function raised, as far as the rank can tell (:func:`raymoe.rank.failure.rank_failure`).

    ``RAISED``: its own code failed (a bug, bad data, out of memory): a primary failure. ``LOST_PEER``: a
    collective failed because another member went away (connection closed or reset, a communicator aborted):
    a secondary one, the consequence of another rank's failure. ``TIMED_OUT``: a collective waited past the
    collective timeout (the driver then names whom it waited for).
    """

    RAISED = "raised"
    LOST_PEER = "lost its peer"
    TIMED_OUT = "timed out"


@dataclass(frozen=True)
class RankFailure:
    """An exception raised by a rank function, as text (exceptions may not unpickle on the driver): its type,
    message and traceback, its :class:`FailureKind`, and the rank's progress when it raised (the collective a
    lost peer broke, for the driver's message)."""

    error_type: str
    message: str
    traceback: str
    kind: FailureKind = FailureKind.RAISED
    progress: RankProgress | None = None
