"""SDPA's backend choice as a trace-time constant (``raymoe.models.common.sdpa_choice``): what a compiled block with
grouped kv heads asks on CUDA instead of ``torch._fused_sdp_choice``, whose int would break the block's graph. The CUDA
answer itself is checked on a GPU by benchmarks/gpu_context.py; here what the question keeps of a call, and the trace,
on CPU tensors."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch._dynamo.utils import counters
from torch.nn.attention import SDPBackend

from raymoe.models.common.sdpa_choice import call_traits, choice_for_traits, stand_ins


def _tensors(heads, kv_heads, length, key_length, dtype, transposed):
    """``q [2, heads, length, 16]``, ``k, v [2, kv_heads, key_length, 16]``; ``transposed``: k's last dim strided."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, heads, length, 16, generator=gen).to(dtype)
    k = torch.randn(2, kv_heads, 16, key_length, generator=gen).to(dtype).transpose(-1, -2)
    if not transposed:
        k = k.contiguous()
    v = torch.randn(2, kv_heads, key_length, 16, generator=gen).to(dtype)
    return q, k, v


MASKS = {
    "none": lambda length, key_length: None,
    "bool 2-D": lambda length, key_length: torch.ones(length, key_length, dtype=torch.bool).tril(),
    "float 4-D": lambda length, key_length: torch.zeros(2, 1, length, key_length),
}


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("heads", [(4, 2), (4, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_calls_traits_get_sdpas_choice_for_the_call(mask, heads, dtype):
    """Without the lengths, the traits' stand-in tensors get the choice SDPA makes for the real call, over lengths,
    causality and strides: by CPU's rules, on real stand-ins (a fake CPU tensor is answered by no device's rule:
    always the math backend). CUDA answers fake tensors by its own rule: ``benchmarks/gpu_context.py`` checks the
    traced choice against the real call's there."""
    for length, key_length, causal, transposed in [(8, 8, True, False), (8, 8, False, True), (5, 9, True, False),
                                                   (7, 3, False, False), (1, 6, False, True)]:  # fmt: skip
        q, k, v = _tensors(*heads, length, key_length, dtype, transposed)
        allowed = MASKS[mask](length, key_length)
        causal = causal and allowed is None  # SDPA takes a mask or is_causal, not both
        want = int(torch._fused_sdp_choice(q, k, v, allowed, 0.0, causal, scale=0.25, enable_gqa=True))
        stand_in = stand_ins(call_traits(q, k, v, allowed, causal), q.device)
        got = int(torch._fused_sdp_choice(*stand_in, 0.0, causal, scale=0.25, enable_gqa=True))
        assert got == want, (length, key_length, causal, transposed)


def test_the_choice_is_a_constant_dynamo_folds_in_whatever_the_lengths():
    """Traced whole (``fullgraph``: no break) with the lengths static, then symbolic (a new length: automatic dynamic
    shapes), which serve every later length: two graphs for four lengths."""

    def choice_times(q, k, v, allowed):
        return q * choice_for_traits(q.device, call_traits(q, k, v, allowed, False), 0.25)

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(choice_times, backend="eager", fullgraph=True)
    for length in (8, 12, 5, 20):
        q, k, _ = _tensors(4, 2, length, length, torch.float32, False)
        allowed = torch.ones(length, length, dtype=torch.bool).tril()
        expected = choice_for_traits(q.device, call_traits(q, k, k, allowed, False), 0.25)
        assert isinstance(expected, int) and expected != SDPBackend.ERROR.value
        assert torch.equal(compiled(q, k, k, allowed), q * expected)
    assert counters["stats"]["unique_graphs"] == 2


def test_eager_attention_does_not_load_the_compiler():
    """The module (its decorator imports ``torch._dynamo``) is imported by the compiled path only."""
    code = (
        "import sys, torch\n"
        "from raymoe.models.common.row_attention import grouped_attention\n"
        "q, k = torch.randn(1, 4, 6, 8), torch.randn(1, 2, 6, 8)\n"
        "grouped_attention(q, k, k, 0.3, torch.ones(6, 6, dtype=torch.bool).tril())\n"
        "print('torch._dynamo' in sys.modules, 'raymoe.models.common.sdpa_choice' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["False", "False"], done.stdout
