"""Whether the ranks compile their decoder blocks (:mod:`raymoe.parallel.compiled_blocks`): ``from_pretrained``'s
``compile=`` and ``finetune.py --compile/--no-compile``.

    None    the default: compiled where the ranks compute on CUDA GPUs, eager on CPU
    True    compiled on any device (inductor's C++ backend on CPU)
    False   eager everywhere (the escape when a compiled graph misbehaves)

CPU stays eager by default because there compilation costs more than it saves in most runs: on 2 cores a cold
compile of one block shape took 12-45 s per rank (every rank compiles the same graph), for steps 0.77-1.15x as fast
as eager (``benchmarks/results/bench_layouts_compiled.md``). Generation's one-token steps always run eagerly.
"""

from __future__ import annotations

import torch


def check_compile(value: object) -> bool | None:
    """``value`` as the spec holds it; anything but ``True``, ``False`` or ``None`` is one clear error."""
    if value is None or isinstance(value, bool):
        return value
    raise ValueError(f"compile={value!r}: pass True (compile the decoder blocks), False (eager) or None (the default)")


def compiles_on(value: bool | None, device: torch.device) -> bool:
    """Whether a rank computing on ``device`` compiles, given the spec's ``value``."""
    return value if value is not None else device.type == "cuda"
