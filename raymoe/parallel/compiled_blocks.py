"""Regional compilation: each decoder layer's forward compiled by ``torch.compile`` (inductor: C++ on CPU, Triton on
CUDA), one graph reused by every layer of the same shape.

Applied per rank after the plan rules (TP / EP) and activation checkpointing, before FSDP2, as torchtitan orders
them::

    layer.__call__                       eager: forward pre-hooks (FSDP2 all-gather, checkpoint region), then
        layer.forward                    compiled: norms, attention, router, expert GEMMs, residual adds,
                                         with the styles' redistributions traced inside
    post-hooks                           eager: FSDP2 reshard, checkpoint end

Only ``forward`` is replaced (an instance attribute), so the hooks stay eager and parameter names stay the hub's.
Dynamo caches compiled code per code object, so the first layer compiles and the others reuse it while their
guards hold (same shapes, dtypes and module structure). Where a forward cannot be traced whole (token dispatch's
all-to-all, whose split sizes are data: :class:`~raymoe.parallel.styles.expert.EpDispatchExpertsParallel` keeps that
forward eager; the ring of context parallelism likewise), dynamo breaks the graph there and compiles the pieces on both
sides. Nowhere else: a graph break elsewhere (an int dynamo cannot trace, a host sync) cuts the block into frames
compiled on their own, which may recompile for every step's data, and selective activation checkpointing (its hooks
stay eager, around the compiled forward) replays the ops the forward ran and finds each compiled region by the graph
the forward ran, so a recompute that runs other graphs fails at the first backward.
``tests/parallel/test_compiled_blocks.py`` holds every family to no break, ``tests/rank/test_compiled_blocks.py``
the layouts that break by design to those breaks.

Row lengths follow ``torch.compile``'s default (``dynamic=None``, automatic dynamic shapes): the first batch shape
compiles graphs specialised to it; the first time a length changes (RL rollouts pad each batch to its longest row),
dynamo compiles the forward again with it symbolic, and that graph serves every later length. So a run whose lengths
change every step compiles twice per mode (training, a forward without gradients), not once per length (with static
shapes, ``dynamic=False``, every new length compiled for as long again, up to the limit:
``benchmarks/bench_dynamic_shapes.py``). The batch dim of the hidden states stays static (``mark_static``): a rank's
rows per micro-batch are fixed by the layout, and a short last evaluation batch compiles a graph of its own, rather
than making the batch size symbolic for every graph compiled after it (dynamo tracks sizes per code object, across
training and evaluation). Dynamo's ``recompile_limit`` (raised to :data:`RECOMPILE_LIMIT`) still bounds the graphs a
layer's forward may collect; past it dynamo runs that forward eagerly (the same numbers, slower). The count starts
again at every load (:func:`compile_blocks`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from raymoe.models.common.decoder import CausalLM

COMPILED_ATTR = "_raymoe_compiled"
# Graphs one decoder forward may hold: a few shapes (training rows, evaluation rows, a last short batch) per mode.
RECOMPILE_LIMIT = 16
CACHE_ARG = 3  # DecoderLayer.forward(x, cos, sin, cache, ...)
HIDDEN_ARG = "x_BSH"


def compile_blocks(model: CausalLM, backend: str = "inductor") -> int:
    """Compile every decoder layer ``model`` runs (in place) with the ``torch.compile`` ``backend``; returns how many.
    A second call is refused.

    Dynamo's caches are reset first (``torch._dynamo.reset``): its graphs are kept per code object, which every
    decoder layer of a class shares with those of models loaded earlier in this process (a world outlives a model),
    and its recompile limit counts them all; without the reset, a world that loaded enough models would run the next
    one's blocks eagerly, silently. So each load starts from none (inductor's on-disk cache still serves a graph it
    compiled before)."""
    torch._dynamo.reset()
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    layers = [model.model.layers[index] for index in model.kept_layers()]
    for layer in layers:
        if getattr(layer, COMPILED_ATTR, False):
            raise ValueError(f"{type(layer).__name__} is compiled already: compile_blocks applies once")
        layer.forward = _compiled(layer, backend)
        setattr(layer, COMPILED_ATTR, True)
    return len(layers)


def is_compiled(module: nn.Module) -> bool:
    """Whether ``module`` holds a decoder layer :func:`compile_blocks` compiled."""
    return any(getattr(layer, COMPILED_ATTR, False) for layer in module.modules())


def _compiled(layer: nn.Module, backend: str) -> Callable[..., Any]:
    """The layer's forward, compiled, except a step with a KV cache (generation), which runs the eager forward: its
    positions change every token, and a one-token step has little to fuse."""
    eager = layer.forward
    compiled = torch.compile(eager, backend=backend)  # dynamic=None: static first, symbolic sizes once one changes

    def forward(*args: Any, **kwargs: Any) -> Any:
        cache = args[CACHE_ARG] if len(args) > CACHE_ARG else kwargs.get("cache")
        if cache is not None:
            return eager(*args, **kwargs)
        hidden_BSH = args[0] if args else kwargs[HIDDEN_ARG]
        torch._dynamo.mark_static(hidden_BSH, 0)
        return compiled(*args, **kwargs)

    return forward


def compile_seconds() -> float:
    """Seconds this process has spent compiling so far (dynamo and inductor, forward and backward graphs)."""
    return float(torch._dynamo.utils.calculate_time_spent().get("total_wall_time", 0.0))
