"""LoRA factors under a parallel style: each is split like its base weight along the dimensions they share.

A factor is a direct parameter of the module that owns its base (``lora_factors`` hint,
:mod:`raymoe.models.common.lora`). ``A [.., r, in]`` shares every dim of ``W [.., out, in]`` but the output
features; ``B [.., out, r]`` every dim but the input features. So a placement of ``W`` carries over to the
factor unless it splits the one dim the factor lacks; then the factor is replicated, and since each rank
then computes only part of its gradient (its slice of the base's split dim), that gradient is summed::

    base W placement              A [.., r, in]                     B [.., out, r]
    Shard(out)  colwise           Replicate, gradient summed        Shard(out)
    Shard(in)   rowwise           Shard(in)                         Replicate, gradient summed
    Shard(0)    experts over ep   Shard(0)                          Shard(0)
    Replicate                     Replicate                         Replicate
"""

from __future__ import annotations

from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate

from raymoe.models.common.lora import FactorRole, lora_factors
from raymoe.parallel.sharding import shard_dim


def factor_base(module: nn.Module, param_name: str) -> tuple[str, FactorRole] | None:
    """``(base parameter name, "A" | "B")`` when ``param_name`` is a LoRA factor of ``module``, else None."""
    return lora_factors(module).get(param_name)


def factor_placement(base_placement: Placement, role: FactorRole, ndim: int) -> Placement:
    """The placement of a factor (``ndim`` dims) whose base weight has ``base_placement``."""
    dim = shard_dim(base_placement, ndim)
    if dim is None:
        return Replicate()
    lacking = ndim - 2 if role == "A" else ndim - 1  # A has r where W has out; B has r where W has in
    return Replicate() if dim == lacking else base_placement


def partial_gradient_factors(module: nn.Module) -> set[str]:
    """The factors of ``module`` replicated over a mesh on which their base is split: each rank's gradient of
    such a factor is its part of the sum (read at forward time, from the placements the parameters have then)."""
    partial: set[str] = set()
    for name, (base_name, _) in lora_factors(module).items():
        factor, base = module._parameters.get(name), module._parameters.get(base_name)
        if isinstance(factor, DTensor) and isinstance(base, DTensor) and _replicated(factor) and not _replicated(base):
            partial.add(name)
    return partial


def local_factor(param: Tensor) -> Tensor:
    """The local tensor of a replicated factor whose gradient comes back summed over its mesh."""
    assert isinstance(param, DTensor)
    return param.to_local(grad_placements=[Partial()] * param.device_mesh.ndim)


def _replicated(tensor: DTensor) -> bool:
    return all(isinstance(p, Replicate) for p in tensor.placements)
