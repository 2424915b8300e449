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
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh


class ParallelStyle:
    """A way to split one module or parameter over one mesh axis. Subclass and override hooks."""

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
