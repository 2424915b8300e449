"""Tensor-parallel styles (SPEC §4): how one dense module or parameter is split over the tp mesh.

``mesh`` is the 1-D tp mesh and ``tp`` its size. Weights use the ``nn.Linear`` layout
``[out, in]`` (expert weights ``[E, out, in]``). Between styled modules the model passes plain
tensors, each rank's local part of a global activation in the layout below; every style runs
the module's own forward on local tensors and changes layouts only at its boundary, through
:func:`~raymoe.parallel.styles.layouts.redistribute_local` (DTensor redistribute, with its autograd)::

    style              parameters (placement)             input (plain)             output (plain)
    colwise            W Shard(out), b Shard(0)           [.., in] Replicate     -> [.., out/tp] Shard(-1)
    colwise_rep        as colwise                         [.., in] Replicate     -> [.., out] Replicate (all-gather)
    rowwise            W Shard(in), b Replicate           [.., in/tp] Shard(-1)  -> [.., out] Replicate (all-reduce, +b)
    rowwise_rep        as rowwise                         [.., in] Replicate, split here -> as rowwise
    packed_colwise     W, b _StridedShard(out, sf)        as colwise; output packed, chunk(sf) stays aligned
    packed_rowwise     W _StridedShard(in, sf)            [.., in/tp] packed     -> as rowwise
    embedding_rowwise  W [V, H] Shard(0)                  ids Replicate          -> [.., H] Replicate (all-reduce)
    embedding_colwise  W [V, H] Shard(1)                  ids Replicate          -> [.., H] Replicate (all-gather)
    replicated_with_grad_allreduce  Replicate             local activations as they are; parameter grad all-reduced
    sequence_parallel               Replicate             [B, S/tp, ..] Shard(1) -> same; parameter grad all-reduced
    all_reduce         (not sharded)                      as is                  -> partial output all-reduced
    local_params       (own parameter rules shard them)   the forward sees the local shards of its parameters
    mla_kv_a_proj      (not sharded)                      as is                  -> RoPE part's gradient all-reduced

Gradients follow from the layouts: a Replicate input consumed by a colwise layer gets its
gradient all-reduced (once for all the colwise layers of one input where a model names them,
:mod:`raymoe.parallel.input_boundary`); a replicated parameter that sees only this rank's part of the
activations (norms on local heads or local sequence) gets its gradient all-reduced.

A style applied to a parameter it cannot split evenly fails in ``validate_param``, on the driver,
before any weight is read. Attention projections are split by whole heads when the module
declares ``tp_block_size`` (models set it to ``head_dim`` on q/k/v/o projections).

The reference's DeepGEMM Mega-MoE styles (SPEC STYLE-3) need that GPU kernel; they are not
implemented and not registered.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor

from raymoe.models.common.shard_hints import EXPERT_BATCHED_ATTR, ROPE_DIM_ATTR, SHARD_BLOCK_ATTR
from raymoe.parallel.adapters import factor_base, factor_placement
from raymoe.parallel.sharding import num_pieces, shard_dim, strided_shard
from raymoe.parallel.styles.base import ParallelStyle
from raymoe.parallel.styles.layouts import all_reduce_backward, all_reduce_forward, redistribute_local, swap_parameters

# --- parameters: one placement each ------------------------------------------------------------


class ShardingStyle(ParallelStyle):
    """A style that gives each parameter it covers one placement; checking and sharding follow from it."""

    def placement(self, module: nn.Module, param_name: str, param: Tensor) -> Placement:
        """Where ``param`` lives over the tp mesh."""
        raise NotImplementedError(f"{type(self).__name__} must define placement()")

    def placement_of(self, module: nn.Module, param_name: str, param: Tensor) -> Placement:
        """:meth:`placement`, or for a LoRA factor the placement its base weight's carries over to it
        (:mod:`raymoe.parallel.adapters`)."""
        factor = factor_base(module, param_name)
        if factor is None:
            return self.placement(module, param_name, param)
        base_name, role = factor
        base = module._parameters[base_name]
        assert base is not None
        return factor_placement(self.placement(module, base_name, base), role, param.ndim)

    def validate_param(self, module: nn.Module, param_name: str, param: Tensor, mesh_size: int) -> None:
        factor = factor_base(module, param_name)
        block_name = factor[0] if factor is not None else param_name  # a factor's split dim has its base's blocks
        check_splittable(module, block_name, param, self.placement_of(module, param_name, param), mesh_size)

    def shard_param(self, module: nn.Module, param_name: str, param: Tensor, mesh: DeviceMesh) -> Tensor:
        return distribute_parameter(param, mesh, self.placement_of(module, param_name, param))


def distribute_parameter(param: Tensor, mesh: DeviceMesh, placement: Placement) -> nn.Parameter:
    """``param`` as a DTensor parameter of this rank's part under ``placement``.

    On the meta device it is a placeholder whose placement tells the loader what to read; a real
    ``param`` (the same full tensor on every rank) is cut locally, without communication.
    """
    if isinstance(param, DTensor):
        raise ValueError(f"parameter is already a DTensor with placements {param.placements}; it is sharded once")
    local_part = distribute_tensor(param.detach(), mesh, [placement], src_data_rank=None)
    return nn.Parameter(local_part, requires_grad=param.requires_grad)


def check_splittable(module: nn.Module, param_name: str, param: Tensor, placement: Placement, mesh_size: int) -> None:
    """Raise ``ValueError`` (naming ``param_name`` and its shape) unless ``placement`` splits it ``mesh_size`` ways."""
    if isinstance(placement, Replicate):
        return
    if param.ndim == 0:
        raise ValueError(f"{param_name} is a scalar; {placement} cannot split it")
    dim = shard_dim(placement, param.ndim)
    assert dim is not None  # ShardingStyle placements are Replicate, Shard or _StridedShard
    size, pieces, block = param.shape[dim], num_pieces(placement), shard_block_size(module, param_name)
    if size % (pieces * mesh_size * block) == 0:
        return
    detail = f"dim {dim} has size {size}"
    if pieces > 1:
        detail += f", {pieces} packed pieces of {size / pieces:g} that are split separately"
    if block > 1:
        detail += f", in blocks of {block} ({type(module).__name__}.{SHARD_BLOCK_ATTR}, e.g. attention heads)"
    what = "equal parts of whole blocks" if block > 1 else "equal parts"
    raise ValueError(f"{param_name} {tuple(param.shape)}: {detail}; it does not split into {mesh_size} {what}")


def shard_block_size(module: nn.Module, param_name: str) -> int:
    """The indivisible block of ``param_name``'s split dim: the module's ``tp_block_size`` (int or per parameter)."""
    block = getattr(module, SHARD_BLOCK_ATTR, 1)
    if isinstance(block, Mapping):
        block = block.get(param_name.rpartition(".")[2], 1)
    if not isinstance(block, int) or isinstance(block, bool) or block < 1:
        raise ValueError(f"{type(module).__name__}.{SHARD_BLOCK_ATTR} must be a positive int, got {block!r}")
    return block


def _expert_dims(module: nn.Module) -> int:
    """1 when every parameter of ``module`` leads with the expert dim (``expert_batched``), else 0."""
    return 1 if getattr(module, EXPERT_BATCHED_ATTR, False) else 0


def _out_features_dim(module: nn.Module, param: Tensor) -> int:
    """Output features: dim 0 of a Linear weight [out, in] or bias [out]; dim 1 of an expert weight
    [E, out, in] or expert bias [E, out]."""
    return _expert_dims(module) or max(param.ndim - 2, 0)


def _in_features_dim(param: Tensor) -> int:
    return param.ndim - 1


def _is_bias(module: nn.Module, param: Tensor) -> bool:
    """A bias: ``[out]``, or ``[E, out]`` on an expert-batched module."""
    return param.ndim == 1 + _expert_dims(module)


def _checked_split_factor(split_factor: int) -> int:
    if not isinstance(split_factor, int) or split_factor < 1:
        raise ValueError(
            f"split_factor (how many layers a packed weight holds) must be an int >= 1, got {split_factor!r}"
        )
    return split_factor


# --- linear layers -----------------------------------------------------------------------------


class ColwiseParallel(ShardingStyle):
    """Split the output features. ``x [.., in]`` Replicate -> ``y [.., out/tp]`` Shard(-1) -> ``output_layout``.

    ``output_layout`` Shard(-1) leaves ``y`` local for a following rowwise layer; Replicate all-gathers it.
    Each rank computes the part of ``x``'s gradient that flows through its output features, so the
    backward all-reduces it.
    """

    def __init__(self, *, output_layout: Placement | None = None) -> None:
        self.output_layout = output_layout if output_layout is not None else Shard(-1)

    def placement(self, module: nn.Module, param_name: str, param: Tensor) -> Placement:
        return Shard(_out_features_dim(module, param))

    def local_output_layout(self) -> Placement:
        """The layout the local forward produces."""
        return Shard(-1)

    def should_use_local_tensors(self, module: nn.Module) -> bool:
        return True

    def transform_inputs_pre_forward(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], mesh: DeviceMesh
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if getattr(module, _BOUNDARY_AT_PARENT_ATTR, False):
            return args, kwargs
        return _map_first(args, kwargs, module, lambda x: self.input_boundary(x, mesh))

    @staticmethod
    def input_boundary(x: Tensor, mesh: DeviceMesh) -> Tensor:
        """``x [.., in]`` Replicate, unchanged; backward: its gradient, partial on each rank, all-reduced."""
        return redistribute_local(x, mesh, Replicate(), Replicate(), grad=Partial())

    @staticmethod
    def leave_input_boundary_to_parent(module: nn.Module) -> None:
        """``module``'s input has passed :meth:`input_boundary` already, in its parent's forward
        (:mod:`raymoe.parallel.input_boundary`): its forward takes it as it is."""
        setattr(module, _BOUNDARY_AT_PARENT_ATTR, True)

    def transform_output_post_forward(self, module: nn.Module, output: Any, mesh: DeviceMesh) -> Any:
        if getattr(module, _KEEP_OUTPUT_SHARDED_ATTR, False):
            return DTensor.from_local(output, mesh, [self.local_output_layout()], run_check=False)
        return redistribute_local(output, mesh, self.local_output_layout(), self.output_layout)

    @contextmanager
    def output_kept_sharded(self, module: nn.Module) -> Iterator[None]:
        """Within the block, ``module``'s forward returns its output as a DTensor in the local layout
        (``[.., out]`` Shard(-1) over tp) instead of moving it to ``output_layout``, so a consumer that
        works on shards (a vocabulary-parallel loss) skips the all-gather."""
        setattr(module, _KEEP_OUTPUT_SHARDED_ATTR, True)
        try:
            yield
        finally:
            delattr(module, _KEEP_OUTPUT_SHARDED_ATTR)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(output_layout={self.output_layout})"


_KEEP_OUTPUT_SHARDED_ATTR = "_raymoe_keep_output_sharded"
_BOUNDARY_AT_PARENT_ATTR = "_raymoe_input_boundary_at_parent"


class PackedColwiseParallel(ColwiseParallel):
    """Colwise for weights packing ``split_factor`` layers along the output features (``gate_up_proj`` = [gate; up]).

    Each packed piece is split separately (``_StridedShard``, picture in :mod:`raymoe.parallel.sharding`), so
    ``chunk(split_factor)`` of the local output is still one part of each piece. The output stays local.
    """

    def __init__(self, *, split_factor: int = 2) -> None:
        self.split_factor = _checked_split_factor(split_factor)
        super().__init__(output_layout=self.local_output_layout())

    def placement(self, module: nn.Module, param_name: str, param: Tensor) -> Placement:
        return strided_shard(_out_features_dim(module, param), self.split_factor)

    def local_output_layout(self) -> Placement:
        return strided_shard(-1, self.split_factor)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(split_factor={self.split_factor})"


class RowwiseParallel(ShardingStyle):
    """Split the input features. ``x`` (``input_layout``) -> ``[.., in/tp]`` -> partial ``y [.., out]`` -> output.

    ``input_layout`` Shard(-1) takes the local output of a colwise layer; Replicate splits a full
    input here. The partial sums are all-reduced (reduce-scattered for an ``output_layout`` Shard(d));
    the bias (Replicate) is added once, after that reduction (its gradient summed when the output is sharded).
    """

    def __init__(self, *, input_layout: Placement | None = None, output_layout: Placement | None = None) -> None:
        self.input_layout = input_layout if input_layout is not None else self.local_input_layout()
        self.output_layout = output_layout if output_layout is not None else Replicate()

    def placement(self, module: nn.Module, param_name: str, param: Tensor) -> Placement:
        return Replicate() if _is_bias(module, param) else Shard(_in_features_dim(param))

    def local_input_layout(self) -> Placement:
        """The layout the local forward needs."""
        return Shard(-1)

    def should_use_local_tensors(self, module: nn.Module) -> bool:
        return True

    def transform_inputs_pre_forward(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], mesh: DeviceMesh
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return _map_first(
            args, kwargs, module, lambda x: redistribute_local(x, mesh, self.input_layout, self.local_input_layout())
        )

    def context_around_forward(self, module: nn.Module, mesh: DeviceMesh) -> AbstractContextManager[Any]:
        # The local forward must produce only its partial product: a bias added on every rank would be summed tp times.
        return swap_parameters(module, lambda name, param: None if name == "bias" else param)

    def transform_output_post_forward(self, module: nn.Module, output: Any, mesh: DeviceMesh) -> Any:
        output = redistribute_local(output, mesh, Partial(), self.output_layout)
        param = module._parameters.get("bias")
        if param is None:
            return output
        bias: Tensor = param.to_local() if isinstance(param, DTensor) else param
        if self.output_layout != Replicate():
            # Each rank adds the bias to its part of the output only, so its gradient is partial.
            bias = all_reduce_backward(bias, mesh)
        return output + bias

    def __repr__(self) -> str:
        return f"{type(self).__name__}(input_layout={self.input_layout}, output_layout={self.output_layout})"


class PackedRowwiseParallel(RowwiseParallel):
    """Rowwise for weights packed along their last dimension, split piece by piece (``_StridedShard``).

    As a parameter rule it splits e.g. an expert ``gate_up_proj [E, H, 2I]`` used as ``x @ W``; as a
    module rule its input is the packed local output of a ``packed_colwise`` layer. 1-D parameters are replicated.
    """

    def __init__(self, *, split_factor: int = 2) -> None:
        self.split_factor = _checked_split_factor(split_factor)
        super().__init__()

    def placement(self, module: nn.Module, param_name: str, param: Tensor) -> Placement:
        return Replicate() if _is_bias(module, param) else strided_shard(_in_features_dim(param), self.split_factor)

    def local_input_layout(self) -> Placement:
        return strided_shard(-1, self.split_factor)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(split_factor={self.split_factor})"


# --- embeddings --------------------------------------------------------------------------------


class EmbeddingParallel(ShardingStyle):
    """``nn.Embedding`` with the token ids replicated; weight ``[V, H]`` split on ``shard_dim``.

    ``shard_dim=0`` splits the vocabulary: each rank looks up the ids in its slice (others read as
    zero rows) and the partial lookups are all-reduced. ``shard_dim=1`` splits the hidden dim:
    each rank looks up its slice of every vector and the slices are all-gathered.
    """

    def __init__(self, *, shard_dim: int) -> None:
        if shard_dim not in (0, 1):
            raise ValueError(f"EmbeddingParallel splits the vocabulary (0) or the hidden dim (1), got {shard_dim}")
        self.shard_dim = shard_dim

    def placement(self, module: nn.Module, param_name: str, param: Tensor) -> Placement:
        return Shard(self.shard_dim)

    def validate_param(self, module: nn.Module, param_name: str, param: Tensor, mesh_size: int) -> None:
        if param.ndim != 2:
            raise ValueError(f"{param_name} {tuple(param.shape)}: an embedding weight is 2-D [vocab, hidden]")
        if getattr(module, "max_norm", None) is not None:
            # max_norm renormalises the looked-up rows in place, by their norm over the whole hidden dim.
            raise ValueError(f"{type(module).__name__} uses max_norm, which a sharded embedding cannot honour")
        super().validate_param(module, param_name, param, mesh_size)

    def should_use_local_tensors(self, module: nn.Module) -> bool:
        return True

    def install_forward(self, module: nn.Module, mesh: DeviceMesh) -> None:
        if self.shard_dim == 0:
            module.forward = _lookup_local_vocab(module, module.forward, mesh)

    def transform_inputs_pre_forward(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], mesh: DeviceMesh
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return _map_first(args, kwargs, module, lambda ids: redistribute_local(ids, mesh, Replicate(), Replicate()))

    def transform_output_post_forward(self, module: nn.Module, output: Any, mesh: DeviceMesh) -> Any:
        local_layout = Partial() if self.shard_dim == 0 else Shard(-1)
        return redistribute_local(output, mesh, local_layout, Replicate())

    def __repr__(self) -> str:
        return f"{type(self).__name__}(shard_dim={self.shard_dim})"


def _lookup_local_vocab(module: nn.Module, forward: Callable[..., Tensor], mesh: DeviceMesh) -> Callable[..., Tensor]:
    """``forward`` on ids shifted into this rank's vocabulary slice; ids of other slices give zero rows.

    It runs while the weight is the local ``[V/tp, H]`` shard, so its row count is the slice size.
    """

    @functools.wraps(forward)
    def lookup(ids: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        weight = module._parameters["weight"]
        if weight is None:
            raise ValueError(f"{type(module).__name__} has no weight to look ids up in")
        rows = int(weight.shape[0])
        first = mesh.get_local_rank() * rows
        local_ids = ids - first
        foreign = (local_ids < 0) | (local_ids >= rows)
        with _local_padding_idx(module, first, rows):
            output = forward(local_ids.masked_fill(foreign, 0), *args, **kwargs)
        return output.masked_fill(foreign.unsqueeze(-1), 0.0)

    return lookup


@contextmanager
def _local_padding_idx(module: nn.Module, first: int, rows: int) -> Iterator[None]:
    """``padding_idx`` (a global id whose row gets no gradient) as an index into this rank's slice, or None."""
    if not isinstance(module, nn.Embedding) or module.padding_idx is None:
        yield
        return
    padding_idx = module.padding_idx
    module.padding_idx = padding_idx - first if first <= padding_idx < first + rows else None
    try:
        yield
    finally:
        module.padding_idx = padding_idx


# --- replicated parameters that see part of the activations -----------------------------------


class ReplicatedWithGradAllReduce(ShardingStyle):
    """Replicated parameters of a module that sees only this rank's part of the activations.

    E.g. Qwen3's ``q_norm``/``k_norm`` between a colwise and a rowwise layer normalise this rank's
    heads: the forward needs no collective, but each rank's parameter gradient covers only its
    heads, so it is summed over the mesh (in the backward of every forward call).
    """

    def placement(self, module: nn.Module, param_name: str, param: Tensor) -> Placement:
        return Replicate()

    def should_use_local_tensors(self, module: nn.Module) -> bool:
        return True

    def context_around_forward(self, module: nn.Module, mesh: DeviceMesh) -> AbstractContextManager[Any]:
        return swap_parameters(module, lambda _, param: all_reduce_backward(param, mesh))


class SequenceParallel(ReplicatedWithGradAllReduce):
    """A per-token module (norm) on this rank's part of the sequence: ``x [B, S/tp, ..]`` Shard(``sequence_dim``).

    A plain input is taken as this rank's sequence part; a DTensor input is redistributed to it.
    The output stays this rank's sequence part. The replicated parameters' gradients are summed.
    """

    def __init__(self, *, sequence_dim: int = 1) -> None:
        self.sequence_dim = sequence_dim

    def transform_inputs_pre_forward(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], mesh: DeviceMesh
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        sequence = Shard(self.sequence_dim)
        return _map_first(args, kwargs, module, lambda x: redistribute_local(x, mesh, sequence, sequence))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(sequence_dim={self.sequence_dim})"


# --- modules around sharded computations -------------------------------------------------------


class AllReduceParallel(ParallelStyle):
    """All-reduce a module's partial output (each rank's part of a sum) to Replicate; the gradient passes through.

    The forward runs on the local shards of the module's own parameters, sharded by their own rules.
    """

    def should_use_local_tensors(self, module: nn.Module) -> bool:
        return True

    def transform_output_post_forward(self, module: nn.Module, output: Any, mesh: DeviceMesh) -> Any:
        return None if output is None else all_reduce_forward(output, mesh)


class LocalParamsParallel(ParallelStyle):
    """Run the module's forward with its own sharded parameters as local tensors.

    For a bare ``nn.Parameter`` with no forward of its own (e.g. attention sinks): its own rule
    shards it, and this style goes on the module that uses it.
    """

    def should_use_local_tensors(self, module: nn.Module) -> bool:
        return True


class MlaKvAProjParallel(ParallelStyle):
    """DeepSeek MLA ``kv_a_proj_with_mqa``: output ``[.., kv_lora_rank + qk_rope_head_dim]``, replicated weight.

    The first part goes through ``kv_b_proj`` (colwise, whose input gradient is all-reduced); the
    RoPE part goes straight to attention on this rank's heads, so its gradient is partial and is
    all-reduced here. The module must declare ``qk_rope_head_dim`` (MLA models set it)::

        kv_a_proj_with_mqa -> split -> k_pass -> kv_a_layernorm -> kv_b_proj (colwise) -> k_pass
                                    \\-> k_rot (gradient all-reduced here) -----------------> k_rot
    """

    def validate_param(self, module: nn.Module, param_name: str, param: Tensor, mesh_size: int) -> None:
        rope_dim = _rope_dim(module)
        if param_name == "weight" and (param.ndim != 2 or param.shape[0] <= rope_dim):
            raise ValueError(
                f"{param_name} {tuple(param.shape)}: expected [kv_lora_rank + {ROPE_DIM_ATTR}, hidden] with "
                f"{ROPE_DIM_ATTR}={rope_dim}"
            )

    def transform_output_post_forward(self, module: nn.Module, output: Any, mesh: DeviceMesh) -> Any:
        rope_dim = _rope_dim(module)
        passed, rope = output.split([output.shape[-1] - rope_dim, rope_dim], dim=-1)
        return torch.cat([passed, all_reduce_backward(rope, mesh)], dim=-1)


def _rope_dim(module: nn.Module) -> int:
    rope_dim = getattr(module, ROPE_DIM_ATTR, None)
    if not isinstance(rope_dim, int) or isinstance(rope_dim, bool) or rope_dim < 1:
        raise ValueError(
            f"mla_kv_a_proj needs {type(module).__name__}.{ROPE_DIM_ATTR} (a positive int, set by the MLA model), "
            f"got {rope_dim!r}"
        )
    return rope_dim


# --- helpers -----------------------------------------------------------------------------------


def _map_first(
    args: tuple[Any, ...], kwargs: dict[str, Any], module: nn.Module, transform: Callable[[Tensor], Tensor]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Apply ``transform`` to the module's input, its first positional argument."""
    if not args or not isinstance(args[0], Tensor):
        raise ValueError(f"{type(module).__name__}: a tensor-parallel style needs the input tensor as first argument")
    return (transform(args[0]), *args[1:]), kwargs
