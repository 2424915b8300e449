"""Building on ``meta`` skips the initialisers (``raymoe.models.common.skip_init``): nothing to fill there, and
``normal_``'s meta kernel would import ``torch._dynamo`` into a process that never compiles."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

from raymoe.models.common.skip_init import SkipMetaInit

FRESH_PROCESS = textwrap.dedent(
    """
    import sys
    from raymoe.driver.tiny import TINY_MOE_CONFIG
    from raymoe.models.registry import build_model, parse_model_config
    model = build_model(parse_model_config(TINY_MOE_CONFIG), device="meta")
    assert all(p.is_meta for p in model.parameters())
    print("dynamo imported:", "torch._dynamo" in sys.modules)
    """
)


def test_a_meta_build_does_not_import_the_compiler():
    done = subprocess.run([sys.executable, "-c", FRESH_PROCESS], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "dynamo imported: False" in done.stdout, done.stdout


@pytest.mark.parametrize(
    "fill",
    [
        lambda t: nn.init.normal_(t, std=0.5),  # nn.init: the tensor reaches the mode by keyword
        lambda t: nn.init.kaiming_uniform_(t),
        lambda t: nn.init.ones_(t),
        lambda t: t.normal_(),  # a tensor method: the tensor is the first argument
        lambda t: t.fill_(3.0),
    ],
    ids=["normal_", "kaiming_uniform_", "ones_", "Tensor.normal_", "Tensor.fill_"],
)
def test_initialisers_skip_meta_tensors_and_fill_the_others(fill):
    with SkipMetaInit():
        meta = torch.empty(4, 3, device="meta")
        assert fill(meta) is meta
        real = torch.zeros(4, 3)
        assert fill(real) is real
    assert not torch.equal(real, torch.zeros(4, 3))
    assert meta.shape == (4, 3) and meta.is_meta


def test_other_calls_run_as_usual_and_modules_keep_their_shapes():
    with torch.device("meta"), SkipMetaInit():
        embedding = nn.Embedding(10, 4, padding_idx=0)
        linear = nn.Linear(4, 6)
        doubled = torch.ones(2, 2) * 2
    assert embedding.weight.shape == (10, 4) and embedding.weight.is_meta
    assert linear.weight.shape == (6, 4) and linear.bias is not None and linear.bias.shape == (6,)
    assert doubled.is_meta and doubled.shape == (2, 2)
