"""Whether the ranks compile their decoder blocks (:mod:`raymoe.parallel.compiled_blocks`), and with which
``torch.compile`` backend: ``from_pretrained``'s ``compile=`` and ``finetune.py --compile/--no-compile``.

    None        the default: compiled where the ranks compute on CUDA GPUs (inductor), eager on CPU
    True        compiled on any device, by inductor (C++ on CPU, Triton on CUDA)
    "<backend>" compiled on any device by that ``torch.compile`` backend: ``"inductor"`` is ``True``;
                ``"aot_eager"`` traces the same graphs (dynamo, AOT autograd) but runs them with eager kernels:
                seconds to compile instead of tens, no speed-up (to tell an inductor problem from a tracing one,
                and what the test suite checks most layouts with)
    False       eager everywhere (the escape when a compiled graph misbehaves)

CPU stays eager by default because there compilation costs more than it saves in most runs: on 2 cores a cold
compile of one block shape took 12-45 s per rank (every rank compiles the same graph), for steps 0.77-1.15x as fast
as eager (``benchmarks/results/bench_layouts_compiled.md``). Generation's one-token steps always run eagerly.
"""

from __future__ import annotations

import torch

CompileChoice = bool | str | None
DEFAULT_BACKEND = "inductor"


def check_compile(value: object) -> CompileChoice:
    """``value`` as the spec holds it; anything but ``True``, ``False``, ``None`` or the name of a ``torch.compile``
    backend is one clear error."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str):
        import torch._dynamo

        backends = torch._dynamo.list_backends(exclude_tags=())
        if value in backends:
            return value
        raise ValueError(
            f"compile={value!r} is not a torch.compile backend: pass True (inductor), False (eager), None (default) "
            f"or one of {', '.join(sorted(backends))}"
        )
    raise ValueError(
        f"compile={value!r}: pass True (compile the decoder blocks), False (eager), None (the default) or the name of "
        "a torch.compile backend ('inductor', 'aot_eager', ...)"
    )


def compiles_on(value: CompileChoice, device: torch.device) -> bool:
    """Whether a rank computing on ``device`` compiles, given the spec's ``value``."""
    return value is not False if value is not None else device.type == "cuda"


def backend_of(value: CompileChoice) -> str:
    """The ``torch.compile`` backend the spec's ``value`` names (inductor unless a name is given)."""
    return value if isinstance(value, str) else DEFAULT_BACKEND
