"""Building a model on the ``meta`` device without running its initialisers.

A meta tensor has a shape and a dtype but no values, so filling it changes nothing. It is not free either: the meta
kernel of ``Tensor.normal_`` (``nn.Embedding``'s initialiser) is a Python reference whose first call imports
``torch._dynamo``, into every process that builds a meta model (the driver and each rank at load), compiling or not.
On the driver, ``prepare_launch`` took 0.75-1.04 s with that import and 0.01 s without.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

# In-place fills of a tensor's values: nn.init's initialisers and the tensor methods they call.
INITIALISERS: frozenset[Callable[..., Any]] = frozenset(
    {
        nn.init.uniform_,
        nn.init.normal_,
        nn.init.trunc_normal_,
        nn.init.constant_,
        nn.init.ones_,
        nn.init.zeros_,
        nn.init.eye_,
        nn.init.dirac_,
        nn.init.xavier_uniform_,
        nn.init.xavier_normal_,
        nn.init.kaiming_uniform_,
        nn.init.kaiming_normal_,
        nn.init.orthogonal_,
        nn.init.sparse_,
        torch.Tensor.normal_,
        torch.Tensor.uniform_,
        torch.Tensor.exponential_,
        torch.Tensor.log_normal_,
        torch.Tensor.cauchy_,
        torch.Tensor.geometric_,
        torch.Tensor.bernoulli_,
        torch.Tensor.random_,
        torch.Tensor.fill_,
        torch.Tensor.zero_,
    }
)


class SkipMetaInit(TorchFunctionMode):
    """``with SkipMetaInit(): ...``: an initialiser called on a meta tensor returns that tensor untouched; any other
    call, and an initialiser of a tensor that has values, runs as usual."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func in INITIALISERS:
            # nn.init passes its tensor by keyword (handle_torch_function), a tensor method as its first argument
            target = args[0] if args else kwargs.get("tensor")
            if isinstance(target, torch.Tensor) and target.is_meta:
                return target
        return func(*args, **kwargs)
