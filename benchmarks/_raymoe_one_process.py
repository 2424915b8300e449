"""The raymoe one-process row of bench_layouts.py: ``raymoe.load_model`` in this process, no Ray, no process group.

Prints ``STEP_SECONDS [...]`` and ``PEAK_MIB [[peak, start]]`` like ``_torchrun_transformers.py``; with a last
argument ``compile``, the decoder blocks are compiled as a rank compiles them, and ``COMPILE_S`` says how long that took
(in the first, warm-up, step).
"""

from __future__ import annotations

import json
import sys
import time

import torch
from _peak_memory import peak_mib, reset

from raymoe import load_model
from raymoe.models import causal_lm_loss
from raymoe.parallel.compiled_blocks import compile_blocks, compile_seconds


def model_and_optimizer(
    directory: str, compiled: bool, device: torch.device
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The row's model in training mode on ``device`` (blocks compiled as a rank compiles them when ``compiled``) and
    its optimizer: fused AdamW, as raymoe's ranks step (``profile_layouts.py --layout one-process`` profiles this)."""
    model = load_model(directory).to(device).train()
    if compiled:
        compile_blocks(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)


def timed_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, ids: torch.Tensor) -> float:
    """Seconds of one training step on ``ids`` (forward, backward, AdamW), waiting for a GPU to finish it."""
    began = time.perf_counter()
    causal_lm_loss(model(ids), ids).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if ids.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - began


def main() -> None:
    directory, batch, seq, vocab, steps, warmup = sys.argv[1:7]
    compiled = sys.argv[7:] == ["compile"]
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    model, optimizer = model_and_optimizer(directory, compiled, device)
    gen = torch.Generator().manual_seed(1)
    times = []
    for step in range(int(steps)):
        if step == int(warmup):
            start = reset(device)
        ids = torch.randint(0, int(vocab), (int(batch), int(seq)), generator=gen).to(device)
        times.append(timed_step(model, optimizer, ids))
    print("STEP_SECONDS " + json.dumps(times), flush=True)
    print("PEAK_MIB " + json.dumps([[peak_mib(device), start]]), flush=True)
    if compiled:
        print("COMPILE_S " + json.dumps(compile_seconds()), flush=True)


if __name__ == "__main__":
    main()
