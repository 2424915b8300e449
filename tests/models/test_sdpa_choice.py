"""SDPA's backend choice as a trace-time constant (``raymoe.models.common.sdpa_choice``): what a compiled block with
grouped kv heads asks on CUDA instead of ``torch._fused_sdp_choice``, whose int would break the block's graph. The CUDA
answer itself is checked on a GPU by benchmarks/gpu_context.py; here the trace, on CPU tensors."""

from __future__ import annotations

import subprocess
import sys

import torch
from torch._dynamo.utils import counters
from torch.nn.attention import SDPBackend

from raymoe.models.common.sdpa_choice import call_layouts, choice_for_layouts


def test_the_choice_is_a_constant_dynamo_folds_in_while_tracing():
    q, k = torch.randn(2, 4, 8, 16), torch.randn(2, 2, 8, 16)
    allowed = torch.ones(8, 8, dtype=torch.bool).tril()

    def choice_times(q, k, v, allowed):
        return q * choice_for_layouts(q.device, call_layouts(q, k, v, allowed), False, 0.25)

    expected = choice_for_layouts(q.device, call_layouts(q, k, k, allowed), False, 0.25)
    assert isinstance(expected, int) and expected != SDPBackend.ERROR.value
    torch._dynamo.reset()
    counters.clear()
    got = torch.compile(choice_times, backend="eager", fullgraph=True)(q, k, k, allowed)  # fullgraph: no break
    assert torch.equal(got, q * expected)
    assert counters["stats"]["unique_graphs"] == 1


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
