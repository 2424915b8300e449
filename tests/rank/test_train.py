"""A training step's memory on a rank (raymoe.rank.train): the logits ``[b, S, V]`` are gone before their gradient
is computed, so the step's peak holds one vocabulary-wide tensor less than a loop that keeps them; the AdamW step
allocates no temporaries the size of the parameters."""

from __future__ import annotations

import sys

import pytest
from ray import cloudpickle

cloudpickle.register_pickle_by_value(sys.modules[__name__])

MOE = "moe_e8_k2_mha"


def watch_logits(ctx) -> None:
    """Record, each time the head's output gets its gradient in backward, whether that output is still alive."""
    import weakref

    head = ctx.require_model().model.lm_head
    head.alive_at_backward = []

    def on_forward(module, args, output):
        if output.requires_grad:
            alive = weakref.ref(output)  # a strong reference here would keep the logits alive itself
            output.register_hook(lambda grad: module.alive_at_backward.append(alive() is not None))

    head.register_forward_hook(on_forward)


def alive_at_backward(ctx) -> list[bool]:
    return ctx.require_model().model.lm_head.alive_at_backward


@pytest.mark.parametrize(
    "layout",
    [{"fsdp_size": 2}, {"tp_size": 2}],  # tp: the vocabulary-parallel loss on sharded logits
    ids=["fsdp2", "tp2"],
)
def test_logits_are_freed_before_their_gradient(load_on_world, tiny_checkpoint, padded_batches, layout):
    ids, mask = padded_batches(96, steps=1, rows=4, seq=10)[0]
    with load_on_world(tiny_checkpoint(MOE), layout) as model:
        model.configure_training(lr=1e-3)
        model.run_on_ranks(watch_logits)
        model.train_step(ids, attention_mask=mask, micro_batches=2)
        assert model.run_on_ranks(alive_at_backward) == [[False, False]] * 2


def adamw_step_allocations(ctx) -> tuple[int, int]:
    """Bytes the rank's AdamW step allocates (torch's profiler, CPU) and the bytes of its local parameters."""
    import torch
    from torch.distributed.tensor import DTensor

    loaded = ctx.require_model()
    optimizer = loaded.require_training().optimizer
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for param in params:
        param.grad = torch.ones_like(param)
    optimizer.step()  # the moments exist from here on: what a step allocates after is its temporaries
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        optimizer.step()
    allocated = sum(max(event.self_cpu_memory_usage, 0) for event in prof.events())
    local = [p.to_local() if isinstance(p, DTensor) else p for p in params]
    return allocated, sum(t.numel() * t.element_size() for t in local)


@pytest.mark.parametrize(
    "layout",
    [{"fsdp_size": 2, "ep_size": 2}, {"tp_size": 2}],  # dense and expert DTensor groups; tp2: plain norms too
    ids=["fsdp2-ep2", "tp2"],
)
def test_adamw_step_allocates_no_parameter_sized_temporaries(load_on_world, tiny_checkpoint, layout):
    with load_on_world(tiny_checkpoint(MOE), layout) as model:
        model.configure_training(lr=1e-3)
        for allocated, parameter_bytes in model.run_on_ranks(adamw_step_allocations):
            assert allocated < 0.05 * parameter_bytes, (allocated, parameter_bytes)  # foreach: >= parameter_bytes


def step_peak_bytes(ctx, micro_batches: int, rows: int, seq: int) -> int:
    """The highest total bytes of the tensor storages a training step of ``rows`` rows cut into ``micro_batches``
    micro-batches allocates and still holds, on this rank (activations, gradients, buffers; storages that live
    before the step, the parameters and AdamW moments, are not counted). Every op's new output storages are
    counted at their size after each op, whatever tensors share them: 0 once freed by resizing (FSDP2's gathered
    weights, the reduce-scatter's receive buffer), nothing once the storage itself is gone. The step before the
    measured one creates the AdamW moments, so the measured one allocates what every later step does."""
    import weakref

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    from raymoe.rank.contract import MicroBatch
    from raymoe.rank.train import train_step

    class LiveStorages(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.peak = 0
            self.tracked: dict[int, weakref.ref] = {}  # the storages ops made, by their C++ object

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            inputs = {_identity(t) for t in tree_leaves((args, kwargs)) if _real(t)}
            for tensor in tree_leaves(out):
                if _real(tensor):
                    storage = tensor.untyped_storage()
                    key = _identity(tensor)
                    if key not in inputs and key not in self.tracked:
                        self.tracked[key] = weakref.ref(storage, lambda _, key=key: self.tracked.pop(key, None))
            live = sum(storage.nbytes() for ref in list(self.tracked.values()) if (storage := ref()) is not None)
            self.peak = max(self.peak, live)
            return out

    def _real(t) -> bool:
        return isinstance(t, torch.Tensor) and t.device.type != "meta"

    def _identity(t) -> int:
        """The storage itself (its C++ object), not its address: a freed storage's address is handed out again."""
        return t.untyped_storage()._cdata

    ids = torch.randint(0, 96, (rows, seq), generator=torch.Generator().manual_seed(0))
    pieces = [
        MicroBatch(part, part.clone(), torch.ones_like(part, dtype=torch.bool)) for part in ids.chunk(micro_batches)
    ]
    tokens = ids.numel() * ctx.topology.world_size
    train_step(ctx, pieces, tokens)
    meter = LiveStorages()
    with meter:
        train_step(ctx, pieces, tokens)
    return meter.peak


@pytest.mark.parametrize("defer", [False, True], ids=["sharded", "defer_sync"])
def test_gradient_accumulation_keeps_gradients_sharded(load_on_world, tiny_checkpoint, defer):
    """fsdp4: 4 micro-batches peak no higher than 1.1 x one micro-batch of all the rows; the twin with
    ``fsdp_defer_gradient_sync`` (full gradients kept until the last micro-batch) goes past it."""
    layout = {"fsdp_size": 4, "fsdp_defer_gradient_sync": defer}
    with load_on_world(tiny_checkpoint(MOE), layout) as model:
        model.configure_training(lr=1e-3)
        one = model.run_on_ranks(step_peak_bytes, 1, 4, 8)
        four = model.run_on_ranks(step_peak_bytes, 4, 4, 8)
    ratio = max(f / o for f, o in zip(four, one, strict=True))
    if defer:
        assert ratio > 1.1, (one, four)
    else:
        assert ratio <= 1.1, (one, four)
