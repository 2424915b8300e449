"""Tensor-parallel styles of a mixture-of-experts layer (SPEC §4): the experts module and an identity expert.

The experts module takes ``(hidden [T, H], topk_ids [T, k], topk_weights [T, k]) -> [T, H]`` and
holds fused weights ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``. Under ``moe_tp_experts``
their own parameter rules split every expert's intermediate dim (``packed_colwise`` on
``gate_up_proj``, ``rowwise`` on ``down_proj``), so each rank computes every expert on every
token, for its ``I/tp`` slice::

    hidden, topk_weights   Replicate; the backward all-reduces their gradients (each rank's is partial)
          |
    experts on local weights: gate_up [E, 2I/tp, H] -> chunk(2) -> act(gate) * up -> down [E, H, I/tp]
          |
    partial [T, H]  -> all-reduce -> Replicate

Masked expert parallelism (``ep_router`` + ``moe_tp_experts``) uses the same experts style with the
expert dim split instead: each rank's non-local experts are masked, so its output is partial too.

An output bias (gpt-oss's ``down_proj_bias [E, H]``, named by the module's ``output_bias`` hint) is
added to every routed pair. Split over the expert dim (masking) each pair gets it from its expert's
owner only; replicated (tensor parallelism) every rank would add it, so each adds ``bias / size``
and the bias's gradient is summed over the mesh.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from raymoe.models.common.shard_hints import OUTPUT_BIAS_ATTR
from raymoe.parallel.styles.base import ExpertRole, ParallelStyle
from raymoe.parallel.styles.layouts import all_reduce_backward, all_reduce_forward, swap_parameters

# Set on an experts module at apply time: the name of its output bias that each rank adds 1/size of.
_SHARED_OUTPUT_BIAS_ATTR = "_raymoe_shared_output_bias"


class MoeExpertsParallel(ParallelStyle):
    """Experts whose output is each rank's partial sum: all-reduced forward; floating inputs all-reduced backward.

    Every floating-point tensor argument (hidden states, routing weights) is replicated and each
    rank's forward uses it for its part of the sum only, so its gradient is summed over the mesh.
    Integer arguments (expert ids) pass through.
    """

    expert_role = ExpertRole.EXPERTS_PARTIAL_SUM

    def should_use_local_tensors(self, module: nn.Module) -> bool:
        return True

    def install_forward(self, module: nn.Module, mesh: DeviceMesh) -> None:
        # Decided once, when the parameters already carry this mesh's placements.
        name = getattr(module, OUTPUT_BIAS_ATTR, None)
        bias = module._parameters.get(name) if isinstance(name, str) else None
        shared = bias is not None and not _split_over(bias, mesh)
        setattr(module, _SHARED_OUTPUT_BIAS_ATTR, name if shared else None)

    def context_around_forward(self, module: nn.Module, mesh: DeviceMesh) -> AbstractContextManager[Any]:
        name = getattr(module, _SHARED_OUTPUT_BIAS_ATTR, None)
        if name is None or mesh.size() == 1:
            return nullcontext()
        size = mesh.size()
        return swap_parameters(
            module, lambda param_name, param: all_reduce_backward(param, mesh) / size if param_name == name else param
        )

    def transform_inputs_pre_forward(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], mesh: DeviceMesh
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        args = tuple(_replicated_input(arg, mesh) for arg in args)
        kwargs = {name: _replicated_input(arg, mesh) for name, arg in kwargs.items()}
        return args, kwargs

    def transform_output_post_forward(self, module: nn.Module, output: Any, mesh: DeviceMesh) -> Any:
        return None if output is None else all_reduce_forward(output, mesh)


class MoeIdentityParallel(ParallelStyle):
    """An identity (or zero) expert inside TP experts: its input is divided by ``tp``.

    Its output is the same on every rank, but the experts' output all-reduce sums it ``tp`` times;
    pre-dividing cancels that (and the gradient, summed by the experts' input all-reduce, stays exact).
    """

    def transform_inputs_pre_forward(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], mesh: DeviceMesh
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if not args or not isinstance(args[0], Tensor):
            raise ValueError(f"{type(module).__name__}: moe_identity_expert needs the input tensor as first argument")
        return (args[0] / mesh.size(), *args[1:]), kwargs


def _split_over(param: Tensor, mesh: DeviceMesh) -> bool:
    """``param`` is a DTensor split (Shard) over ``mesh``."""
    return (
        isinstance(param, DTensor)
        and param.device_mesh == mesh
        and any(isinstance(placement, Shard) for placement in param.placements)
    )


def _replicated_input(arg: Any, mesh: DeviceMesh) -> Any:
    if isinstance(arg, Tensor) and arg.is_floating_point():
        return all_reduce_backward(arg, mesh)
    return arg
