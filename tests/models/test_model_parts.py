"""A model cut into parts (``CausalLM.keep_part``, what a pipeline stage runs) computes the whole model's logits and
KV-cached continuation when the parts run in turn, and keeps the parameter names of the whole model."""

from __future__ import annotations

import copy

import pytest
import torch

from raymoe.checkpoint import load_model
from raymoe.models.common.decoder import SkippedLayer

NAME = "moe_e5_k3_gqa2_dense_mid"  # 3 layers, a dense one in the middle


def _parts(model, starts):
    ends = [*starts[1:], model.config.num_hidden_layers]
    parts = []
    for index, (start, end) in enumerate(zip(starts, ends, strict=True)):
        part = copy.deepcopy(model)
        part.keep_part(range(start, end), embedding=index == 0, head=index == len(starts) - 1)
        parts.append(part)
    return parts


@pytest.mark.parametrize("starts", [(0, 1), (0, 2), (0, 1, 2)])
def test_parts_in_turn_equal_the_whole_model(tiny_checkpoint, starts):
    model = load_model(tiny_checkpoint(NAME)).eval()
    parts = _parts(model, starts)
    ids = torch.randint(0, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    documents = torch.tensor([[0, 0, 0, 1, 1, 1, 1], [0, 0, 1, 1, 1, 2, 2]])
    with torch.no_grad():
        hidden = ids
        for part in parts:
            hidden = part(hidden, document_ids_BS=documents)
        torch.testing.assert_close(hidden, model(ids, document_ids_BS=documents), rtol=0, atol=0)
        # cached decoding: one cache per part, prompt then one token
        caches = [part.new_cache(8) for part in parts]
        whole_cache = model.new_cache(8)
        for step in (ids, ids[:, :1]):
            hidden = step
            for part, cache in zip(parts, caches, strict=True):
                hidden = part(hidden, cache)
            torch.testing.assert_close(hidden, model(step, whole_cache), rtol=0, atol=0)
    names = [name for part in parts for name, _ in part.named_parameters()]
    assert sorted(names) == sorted(name for name, _ in model.named_parameters())  # each once, same names


def test_a_part_holds_only_its_layers(tiny_checkpoint):
    model = load_model(tiny_checkpoint(NAME))
    middle = _parts(model, (0, 1, 2))[1]
    assert middle.kept_layers() == [1] and middle.model.embed_tokens is None and middle.lm_head is None
    assert isinstance(middle.model.layers[0], SkippedLayer) and isinstance(middle.model.layers[2], SkippedLayer)
    assert {name.split(".")[2] for name, _ in middle.named_parameters()} == {"1"}
