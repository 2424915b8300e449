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
