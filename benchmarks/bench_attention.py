"""One gpt-oss-like sink-attention layer, forward + backward, in this checkout's attention against an older one's.

    .venv/bin/python benchmarks/bench_attention.py                       # against a645ec6 (before issue 36)
    .venv/bin/python benchmarks/bench_attention.py --old REV --dtype bfloat16

Shape: B=1, 8 query heads, S = L = 1024, head_dim 64, sinks, 8 or 1 kv heads, sliding window 128 or none. Printed
per case and implementation: the largest float tensor any op returns (the old code's is the per-head scores
``[B, H, S, L]``), the peak of live CPU allocations (torch's profiler memory events, an op's own net at its start),
and the median process CPU time of 3 runs on one thread (CPU time, not wall: this machine is shared). The older
``raymoe/models/common/attention.py`` is read with ``git show REV:...`` and imported by path.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

import raymoe.models.common.attention as current

B, HQ, S, D = 1, 8, 1024, 64
ROOT = Path(__file__).resolve().parent.parent


class Largest(TorchDispatchMode):
    """The largest float tensor (elements) any op returns."""

    def __init__(self) -> None:
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, tuple | list) else (out,):
            if isinstance(tensor, torch.Tensor) and tensor.is_floating_point():
                self.numel = max(self.numel, tensor.numel())
        return out


def old_module(revision: str, directory: Path) -> ModuleType:
    source = subprocess.run(
        ["git", "show", f"{revision}:raymoe/models/common/attention.py"], cwd=ROOT, check=True, capture_output=True
    ).stdout
    path = directory / "old_attention.py"
    path.write_bytes(source)
    spec = importlib.util.spec_from_file_location("old_attention", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def inputs(kv_heads: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(0)

    def make(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(dtype).requires_grad_()

    return make(B, HQ, S, D), make(B, kv_heads, S, D), make(B, kv_heads, S, D), make(HQ)


def peak_bytes(fn: Any) -> int:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    live = peak = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        live += event.self_cpu_memory_usage
        peak = max(peak, live)
    return peak


def measure(module: ModuleType, kv_heads: int, window: int | None, dtype: torch.dtype) -> tuple[int, int, float]:
    q, k, v, sinks = inputs(kv_heads, dtype)

    def step() -> None:
        out = module.masked_attention(q, k, v, 0, D**-0.5, window, sinks, None)
        out.backward(torch.ones_like(out))

    step()  # warm-up
    largest = Largest()
    with largest:
        step()
    peak = peak_bytes(step)
    times = []
    for _ in range(3):
        start = time.process_time()
        step()
        times.append(time.process_time() - start)
    return largest.numel, peak, statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old", default="a645ec6", help="the revision to compare with (default: %(default)s)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        old = old_module(args.old, Path(tmp))
        for kv_heads in (8, 1):
            for window in (128, None):
                (o_n, o_p, o_t), (n_n, n_p, n_t) = (measure(m, kv_heads, window, dtype) for m in (old, current))
                print(
                    f"{args.dtype} kv_heads={kv_heads} window={window}: largest float tensor {o_n} -> {n_n} "
                    f"([B,H,S,L] = {B * HQ * S * S}); peak {o_p / 2**20:.1f} -> {n_p / 2**20:.1f} MiB; "
                    f"CPU time {o_t * 1e3:.0f} -> {n_t * 1e3:.0f} ms ({n_t / o_t:.2f}x)"
                )


if __name__ == "__main__":
    main()
