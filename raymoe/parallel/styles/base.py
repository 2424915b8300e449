"""The base every parallel style subclasses (SPEC STYLE-1).

A plan maps a module or parameter path to a style name; the registry maps the name to a
configured instance of a subclass of :class:`ParallelStyle`. Each hook is a no-op here, so a
style overrides only what it changes. When and where each hook runs:

    driver, meta model   validate_param              reject a bad layout before any weight is read
    rank, meta model     shard_param                 meta param -> DTensor placeholder of this rank's slice
    rank, forward        install_forward             replace forward entirely (last resort)
                         transform_inputs_pre_forward
                         context_around_forward      wraps the module's own forward
                         transform_output_post_forward
                         should_use_local_tensors    run forward on .to_local() params (plain-tensor fast path)

What a style *is* to the rest of raymoe is said by two class attributes, never by its name, so a
user's style under any name is treated like the built-in one it resembles:

    expert_role      its part in expert parallelism (:class:`ExpertRole`): plan resolution picks the
                     EP mechanism (masking or token dispatch) and checks CFG-4 / CFG-5 from it
    shards_experts   it splits the expert dim of the parameters it covers: their module holds expert
                     weights (FSDP2 units over efsdp, the optimizer's expert group)
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from enum import Enum
from typing import Any, ClassVar

from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh


class ExpertRole(Enum):
    """A style's part in expert parallelism (SPEC §5)."""

    NONE = "none"  # not an expert-parallel mechanism (dense styles, expert-weight sharding alone)
    ROUTER_MASK = "router_mask"  # masking, router side: foreign experts' ids masked (EP-2, ep_router)
    EXPERTS_PARTIAL_SUM = "experts_partial_sum"  # masking, experts side: partial outputs all-reduced (moe_tp_experts)
    TOKEN_DISPATCH = "token_dispatch"  # the experts module sends tokens to their experts' owners (EP-3)


class ParallelStyle:
    """A way to split one module or parameter over one mesh axis. Subclass and override hooks."""

    expert_role: ClassVar[ExpertRole] = ExpertRole.NONE
    shards_experts: ClassVar[bool] = False

    def bind_tp(self, tp_mesh: DeviceMesh) -> ParallelStyle:
        """This style for a rank whose tp group is ``tp_mesh``, when applied over another mesh (ep).

        Called on every EP style before it is applied with ``tp_size > 1``; the default ignores it.
        Token dispatch returns a copy that slices its rows over the tp group (EP-4).
        """
        return self

    def validate_param(self, module: nn.Module, param_name: str, param: Tensor, mesh_size: int) -> None:
        """Raise ``ValueError`` (naming the parameter and shapes) if ``param`` cannot be split ``mesh_size`` ways.

        Runs on the driver against the meta model, so it sees shapes but no mesh and no data.
        """

    def shard_param(self, module: nn.Module, param_name: str, param: Tensor, mesh: DeviceMesh) -> Tensor:
        """The placeholder that replaces ``param`` on this rank; its placement tells the loader the slice."""
        return param

    def transform_inputs_pre_forward(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], mesh: DeviceMesh
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return args, kwargs

    def context_around_forward(self, module: nn.Module, mesh: DeviceMesh) -> AbstractContextManager[Any]:
        return nullcontext()

    def transform_output_post_forward(self, module: nn.Module, output: Any, mesh: DeviceMesh) -> Any:
        return output

    def should_use_local_tensors(self, module: nn.Module) -> bool:
        return False

    def install_forward(self, module: nn.Module, mesh: DeviceMesh) -> None:
        """Replace ``module.forward`` outright; for styles the three forward hooks cannot express."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
