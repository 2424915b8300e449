"""Compiled decoder blocks in one process (raymoe.parallel.compiled_blocks): eager's numbers, one graph for every layer,
no graph break, two graphs however the row length changes, and generation left eager."""

import pytest
import torch
from torch._dynamo.utils import counters

from raymoe import load_model
from raymoe.models import causal_lm_loss
from raymoe.models.common.generation import generate
from raymoe.parallel.activation_checkpoint import apply_activation_checkpointing
from raymoe.parallel.compiled_blocks import RECOMPILE_LIMIT, compile_blocks, compile_seconds, is_compiled
from raymoe.spec.compile import backend_of, check_compile, compiles_on

pytestmark = pytest.mark.slow  # dynamo and AOT autograd trace for seconds; make test-fast skips it

MOE = "moe_e8_k2_mha"


def _batches(vocab, shapes, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, shape, generator=gen) for shape in shapes]


def _train(model, batches):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for ids in batches:
        loss = causal_lm_loss(model(ids), ids)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _graphs():
    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


# The graphs of the block, plain and with checkpointing's regions, traced by dynamo and AOT autograd and run on eager
# kernels (aot_eager): what this file asks (eager's numbers, graph counts, a new row length adding one graph, generation
# left eager) dynamo's trace and guards decide, whatever the backend. Inductor's C++ compiles once in the suite, on the
# ranks under FSDP2 (tests/rank/test_compiled_blocks.py: its kernels over parameters FSDP2 gathers and frees each
# step), not here too: 18-32 s on 2 cores (alone, and in a whole suite's run) for the same kernels.
@pytest.mark.parametrize("checkpointing", ["none", "selective"])
def test_compiled_blocks_train_like_eager_with_one_graph_for_every_layer(tiny_checkpoint, checkpointing):
    directory = tiny_checkpoint(MOE)
    eager, compiled = load_model(directory).train(), load_model(directory).train()
    for model in (eager, compiled):
        apply_activation_checkpointing(model, checkpointing)
    torch._dynamo.reset()
    counters.clear()
    assert compile_blocks(compiled, "aot_eager") == len(compiled.model.layers) == 2 and is_compiled(compiled)
    before = compile_seconds()
    batches = _batches(eager.config.vocab_size, [(4, 12)] * 3)
    want, got = _train(eager, batches), _train(compiled, batches)
    assert all(abs(g - w) <= 1e-5 * abs(w) for g, w in zip(got, want, strict=True)), (got, want)
    assert compile_seconds() > before
    assert _graphs() == (1, 0)  # the first layer's graph serves the second; nothing breaks it
    # another row length adds one graph, with the length symbolic (automatic dynamic shapes), which serves the next
    # lengths too: not one graph per length
    more = _batches(eager.config.vocab_size, [(4, 20), (4, 20), (4, 9), (4, 16)], seed=1)
    assert _train(compiled, more) == pytest.approx(_train(eager, more), rel=1e-5)
    assert _graphs() == (2, 0)
    # a batch size is never symbolic: each one compiles a graph of its own (a short last evaluation batch, before
    # training, would otherwise leave every later training graph with the batch size symbolic)
    sizes = _batches(eager.config.vocab_size, [(3, 12), (5, 12)], seed=2)
    assert _train(compiled, sizes) == pytest.approx(_train(eager, sizes), rel=1e-5)
    assert _graphs() == (4, 0)
    # forwards without gradients (evaluation, log-probs): a graph of their own, for any length (symbolic from the
    # first: dynamo saw this forward's length change before, in training)
    with torch.no_grad():
        for ids in _batches(eager.config.vocab_size, [(4, 12), (4, 7), (4, 21)], seed=3):
            torch.testing.assert_close(compiled(ids), eager(ids), rtol=1e-5, atol=1e-5)
    assert _graphs() == (5, 0)
    # generation's cached steps run the eager forward: the same tokens, no graph
    prompt = batches[0][:2, :5]
    with torch.no_grad():
        tokens = generate(compiled, prompt, 4, eos_token_ids=())
        assert torch.equal(tokens, generate(eager, prompt, 4, eos_token_ids=()))
    assert _graphs() == (5, 0)


def test_every_family_compiles_its_blocks_without_a_graph_break(tiny_name, tiny_checkpoint):
    """Grouped-query attention (the kernel choice for grouped heads), sinks and windows, latent attention, shared
    experts, dense layers and the padded grouped GEMM (the tiny shapes that ``torch._grouped_mm`` refuses) all trace,
    with static and with symbolic lengths: a block's forward and backward are one graph per kind of layer (sliding and
    full attention, dense and MoE) and length mode, as eager computes them. Dynamo's trace alone decides this (the
    "eager" backend)."""
    directory = tiny_checkpoint(tiny_name)
    eager, compiled = load_model(directory).train(), load_model(directory).train()
    torch._dynamo.reset()
    counters.clear()
    compile_blocks(compiled, "eager")
    first = None
    # a first length, then two more: the second traces the blocks with the length symbolic, the third reuses that
    for ids in _batches(eager.config.vocab_size, [(2, 12), (2, 9), (2, 16)]):
        want, got = causal_lm_loss(eager(ids), ids), causal_lm_loss(compiled(ids), ids)
        got.backward()
        assert got.item() == pytest.approx(want.item(), rel=1e-6)
        first = first or _graphs()[0]
    graphs, breaks = _graphs()
    assert breaks == 0, dict(counters["graph_break"])
    assert 1 <= first <= 2 and graphs == 2 * first


def test_a_new_model_compiles_whatever_the_graphs_earlier_models_left(tiny_checkpoint):
    """Dynamo keeps graphs per code object, shared by every model's layers of a class: a model loaded after one that
    reached the recompile limit still compiles (the limit counts per load), where it would otherwise run eagerly."""
    directory = tiny_checkpoint(MOE)
    first = load_model(directory)
    compile_blocks(first, "eager")  # dynamo's graphs and limit: its trace alone (the "eager" backend) is enough
    # Static shapes only, so each new row length compiles a graph of its own (with automatic dynamic shapes, the
    # second length's graph would serve them all and the limit would never be reached).
    with torch._dynamo.config.patch(automatic_dynamic_shapes=False), torch.no_grad():
        for length in range(2, RECOMPILE_LIMIT + 3):  # a new row length each time: past the limit
            first(torch.zeros(1, length, dtype=torch.long))
    assert _graphs()[0] >= RECOMPILE_LIMIT
    second = load_model(directory)
    compile_blocks(second, "eager")
    before = _graphs()[0]
    with torch.no_grad():
        second(torch.zeros(1, 3, dtype=torch.long))
    assert _graphs()[0] == before + 1


def test_a_model_compiles_once(tiny_checkpoint):
    model = load_model(tiny_checkpoint(MOE))
    compile_blocks(model)
    with pytest.raises(ValueError, match="compiled already"):
        compile_blocks(model)


def test_the_compile_option_is_a_bool_none_or_a_backend():
    assert check_compile(None) is None and check_compile(True) is True and check_compile("aot_eager") == "aot_eager"
    with pytest.raises(ValueError, match=r"compile='yes' is not a torch.compile backend: .*aot_eager.*inductor"):
        check_compile("yes")
    with pytest.raises(ValueError, match=r"compile=1: pass True.*False.*None"):
        check_compile(1)
    assert compiles_on(None, torch.device("cuda")) and not compiles_on(None, torch.device("cpu"))
    assert compiles_on(True, torch.device("cpu")) and not compiles_on(False, torch.device("cuda"))
    assert compiles_on("aot_eager", torch.device("cpu"))
    assert backend_of(True) == backend_of(None) == "inductor" and backend_of("aot_eager") == "aot_eager"
