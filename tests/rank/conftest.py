"""The layout check every family's multi-rank tests share: train a few steps on the shared world, compare with
transformers in one process, save, reload in transformers."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from ray import cloudpickle

cloudpickle.register_pickle_by_value(sys.modules[__name__])

LR, WEIGHT_DECAY, STEPS, ROWS, SEQ = 1e-3, 0.1, 3, 8, 10
# Trained weights, norm-relative. AdamW divides each element's gradient by its own scale, so an element whose
# gradient cancels to near zero carries its rounding into its update almost whole: one such element of the first
# layer's q_proj, on Qwen3-MoE's tp4-sp data, moves 9e-6 (0.9% of a step) from the reference once tensor
# parallelism sums q, k and v's input gradients before one all-reduce instead of after three, giving 1.01e-5
# (5.6e-6 before; every other weight, and every weight on data seeds 1 to 4: 3e-6 or less, before and after).
# What it must catch sits far above (tests/rank/test_layout_tolerances.py): one parameter trained without weight decay
# ends STEPS * LR * WEIGHT_DECAY = 3e-4 away (15x), one whose gradient is halved for one step ~1e-2.
WEIGHT_RTOL = 2e-5
METRIC_RTOL = 1e-5  # each step's loss and gradient norm, relative
METER = "_layout_test_meter"  # the rank context's attribute holding the meter a layout test started
# RAYMOE_FULL_MATRIX=1: every family on every layout of a `family_layouts` test (make test runs a covering subset)
FULL_MATRIX = os.environ.get("RAYMOE_FULL_MATRIX", "") == "1"


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """``@pytest.mark.family_layouts(families, layouts, every_family=(...), skip=(...))`` parametrizes a test's
    ``(name, layout)`` with :func:`family_layout_cases`."""
    marker = metafunc.definition.get_closest_marker("family_layouts")
    if marker is not None:
        cases = family_layout_cases(*marker.args, **marker.kwargs)
        metafunc.parametrize(("name", "layout"), cases, ids=[f"{name}-{layout}" for name, layout in cases])


def family_layout_cases(
    families: list[str],
    layouts: list[str],
    *,
    every_family: tuple[str, ...] = (),
    skip: tuple[tuple[str, str], ...] = (),
    full: bool = FULL_MATRIX,
) -> list[tuple[str, str]]:
    """The (family, layout) pairs a test trains: with ``full`` every pair but ``skip``; otherwise each family on
    every layout of ``every_family`` (those whose code differs per family: attention split across ranks), and each
    other layout once, the families taken in turn::

        families A B C, layouts p q (every_family) r s t u     ->   A B C on p and q;  r:A s:B t:C u:A

    The layouts' own code is family-agnostic past the styles each family maps to; the full product stays one
    variable away (``RAYMOE_FULL_MATRIX=1``). A turn that lands on a ``skip`` pair passes to the next family."""
    if full:
        return [(family, layout) for layout in layouts for family in families if (family, layout) not in skip]
    cases = [(family, layout) for layout in every_family for family in families if (family, layout) not in skip]
    rest = [layout for layout in layouts if layout not in every_family]
    turn = 0
    for layout in rest:
        allowed = [family for family in families if (family, layout) not in skip]
        if not allowed:
            continue
        family = families[turn % len(families)]
        while family not in allowed:
            turn += 1
            family = families[turn % len(families)]
        cases.append((family, layout))
        turn += 1
    return cases


def start_meter(ctx) -> None:
    """Enter a :class:`~raymoe.rank.host_syncs.HostSyncs` on this rank until :func:`stop_meter`: it counts what the
    handle's own calls in between run on the rank (the layout test's last step, its generation), not a step of its
    own. A rank actor runs every call on one thread, the one the meter's modes are entered on (checked at the stop)."""
    import threading

    from raymoe.rank.host_syncs import HostSyncs

    if hasattr(ctx, METER):
        raise RuntimeError("a meter is running on this rank already")
    setattr(ctx, METER, (HostSyncs().__enter__(), threading.get_ident()))


def stop_meter(ctx) -> tuple[int, int, int, int, dict[str, int]]:
    """Exit the meter :func:`start_meter` entered: :func:`_budget_parts` of what it counted."""
    import threading

    syncs, thread = getattr(ctx, METER)
    delattr(ctx, METER)
    if thread != threading.get_ident():
        raise RuntimeError("the rank ran the metered calls on another thread than the meter's: it counted nothing")
    syncs.__exit__(None, None, None)
    return _budget_parts(ctx, syncs)


@contextlib.contextmanager
def metered(model) -> Iterator[list[tuple[int, int, int, int, dict[str, int]]]]:
    """``with metered(model) as counts: model.train_step(...)``: each rank's :func:`_budget_parts` of the calls in the
    block, in ``counts`` after it. When the block fails the meter is stopped too (the world is shared) and the
    block's error is the one raised."""
    model.run_on_ranks(start_meter)
    counts: list[tuple[int, int, int, int, dict[str, int]]] = []
    try:
        yield counts
    except BaseException:
        with contextlib.suppress(Exception):
            model.run_on_ranks(stop_meter)
        raise
    counts.extend(model.run_on_ranks(stop_meter))


def dynamo_graphs(ctx) -> int:
    """Graphs dynamo compiled in this rank's process so far (its counters add up over every load)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def _budget_parts(ctx, syncs) -> tuple[int, int, int, int, dict[str, int]]:
    """``(syncs, dispatch, fallback, MoE layers this rank holds, {site: count})``: besides one per step or token the
    budget grants token dispatch's split sizes (``dispatch``) and the reads of the padded grouped-GEMM fallback
    (``fallback``: it serves shapes ``torch._grouped_mm`` refuses, e.g. the tiny gpt-oss on CPU, and reads its
    largest expert's row count once per expert matmul; hub shapes in bf16 on a GPU take ``torch._grouped_mm``)."""
    from raymoe.rank.balance import routers

    dispatch = sum(n for site, n in syncs.sites.items() if "/styles/dispatch.py:" in site)
    fallback = sum(n for site, n in syncs.sites.items() if "/moe/grouped_mm.py:" in site)
    moe_layers = sum(len(routers(part)) for part in ctx.require_model().parts)
    return syncs.count, dispatch, fallback, moe_layers, dict(syncs.sites)


def check_step_budget(counts, micro_batches: int, recomputed: int) -> None:
    """The sync budget (issue 36) of a training step: one device -> host sync (the step's answer), plus under token
    dispatch the all-to-all split sizes, one per MoE layer and micro-batch (again in recomputation). The padded GEMM
    fallback's reads are granted too (:func:`_budget_parts`)."""
    for syncs, dispatch, fallback, moe_layers, sites in counts:
        assert syncs - dispatch - fallback <= 1, sites
        assert dispatch in (0, moe_layers * micro_batches * recomputed), sites


def check_decode_budget(counts, new_tokens: int) -> None:
    """The sync budget of decoding ``new_tokens``: one per token (plus one read of the rows' host ids when it starts,
    which the CPU meter counts), plus token dispatch's split sizes at each forward."""
    for syncs, dispatch, fallback, moe_layers, sites in counts:
        assert syncs - dispatch - fallback <= new_tokens + 1, sites
        assert dispatch in (0, moe_layers * new_tokens), sites


TORCH_BETAS = (0.9, 0.999)  # the reference runs torch.optim.AdamW with its defaults, no clipping


@dataclass(frozen=True)
class LayoutCheckRun:
    """What :func:`check_layout` trains by default (AdamW's learning rate and weight decay, the batches' sequence
    length) and the bounds it holds a layout to, norm-relative."""

    lr: float = LR
    weight_decay: float = WEIGHT_DECAY
    seq: int = SEQ
    weight_rtol: float = WEIGHT_RTOL
    metric_rtol: float = METRIC_RTOL


@pytest.fixture(scope="session")
def layout_check_run() -> LayoutCheckRun:
    """:class:`LayoutCheckRun`: for tests of the layout check itself (conftest modules are not importable)."""
    return LayoutCheckRun()


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return (torch.linalg.vector_norm(actual - expected) / torch.linalg.vector_norm(expected).clamp_min(1e-12)).item()


# transformers' run a layout check compares with: (batches, losses, gradient norms, trained model)
Reference = tuple[list[tuple[Any, Any]], list[float], list[float], Any]


@pytest.fixture(scope="session")
def layout_reference(load_hf_model, reference_training, padded_batches) -> Callable[[Path, int], Reference]:
    """``layout_reference(directory, seq)`` -> ``(batches, losses, gradient norms, trained model)``: transformers'
    run that every layout check of that checkpoint and sequence length compares with, computed once per session
    (it is the same run for every layout; the callers only read it)."""
    runs: dict[tuple[Path, int], Reference] = {}

    def get(directory: Path, seq: int) -> Reference:
        key = (Path(directory).resolve(), seq)
        if key not in runs:
            hf_model = load_hf_model(directory)
            data = padded_batches(hf_model.config.vocab_size, steps=STEPS, rows=ROWS, seq=seq)
            runs[key] = (data, *reference_training(hf_model, data, LR, WEIGHT_DECAY))
        data, losses, norms, trained = runs[key]
        return [(ids.clone(), mask.clone()) for ids, mask in data], losses, norms, trained

    return get


@pytest.fixture
def check_layout(
    load_on_world, tiny_checkpoint, load_hf_model, layout_reference
) -> Callable[..., list[dict[str, Any]]]:
    """``check_layout(config, tmp_path, checkpoint=name or directory, micro_batches=1, zero_gradient=(), seq=10,
    **from_pretrained options)`` -> the step metrics.

    Three AdamW steps on padded batches under ``config``: each loss and gradient norm within 1e-5 (relative)
    of transformers training on the whole global batch in one process; the saved checkpoint loads in
    transformers with every weight within 2e-5 of the reference's (``WEIGHT_RTOL``), and gives the handle's logits
    (1e-5) and its greedy continuation of one prompt. The last step and that generation run under the sync meter,
    each rank held to the budgets (:func:`check_step_budget`, :func:`check_decode_budget`). ``zero_gradient`` names
    (suffixes) the parameters whose exact gradient is zero, a key bias under softmax attention without sinks (it
    shifts all of a query's scores alike): AdamW turns their rounding noise into moves of up to lr a step, different
    under every layout, so they are held to that bound.
    """

    def check(
        config: dict[str, Any],
        tmp_path: Path,
        checkpoint: str | Path,
        micro_batches: int = 1,
        zero_gradient: tuple[str, ...] = (),
        seq: int = SEQ,
        **load_options: Any,
    ) -> list[dict[str, Any]]:
        directory = tiny_checkpoint(checkpoint) if isinstance(checkpoint, str) else checkpoint
        data, ref_losses, ref_norms, ref_model = layout_reference(directory, seq)
        with load_on_world(directory, config, **load_options) as model:
            model.configure_training(lr=LR, weight_decay=WEIGHT_DECAY, betas=TORCH_BETAS, max_grad_norm=None)
            graphs_before = model.run_on_ranks(dynamo_graphs)
            *first, (last_ids, last_mask) = data
            metrics = [model.train_step(ids, attention_mask=mask, micro_batches=micro_batches) for ids, mask in first]
            with metered(model) as step_counts:  # the sync budget, on the test's own last step
                metrics.append(model.train_step(last_ids, attention_mask=last_mask, micro_batches=micro_batches))
            if load_options.get("compile"):  # the steps ran compiled graphs, each rank's own, not eager code
                after = model.run_on_ranks(dynamo_graphs)
                assert all(a > b for a, b in zip(after, graphs_before, strict=True)), (graphs_before, after)
            for step, (got, want, norm) in enumerate(zip(metrics, ref_losses, ref_norms, strict=True)):
                assert abs(got["loss"] - want) <= METRIC_RTOL * abs(want), (step, got["loss"], want)
                # the gradient norm spans both meshes, dense and expert (SPEC TRAIN-2)
                assert abs(got["grad_norm"] - norm) <= METRIC_RTOL * norm, (step, got["grad_norm"], norm)
            model.save_pretrained(tmp_path)
            trained = load_hf_model(tmp_path)
            reference = dict(ref_model.named_parameters())
            for name, param in trained.named_parameters():
                if name.endswith(zero_gradient):
                    assert (param - reference[name]).abs().max().item() <= 2 * STEPS * LR, name
                    continue
                error = rel_error(param, reference[name].detach())
                assert error <= WEIGHT_RTOL, (name, error)
            ids = data[0][0]
            with torch.no_grad():
                assert (model(ids) - trained(input_ids=ids).logits).abs().max().item() <= 1e-5
            # one prompt on any layout (idle data-parallel batches decode a copy and are dropped)
            prompt = ids[:1, :6]
            expected = trained.generate(
                prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4, do_sample=False
            )
            with metered(model) as decode_counts:
                generated = model.generate(prompt[0:1].tolist(), 4)
            assert generated == [expected[0].tolist()]
            recomputed = 2 if model.topology.config.activation_checkpointing != "none" else 1
            check_step_budget(step_counts, micro_batches, recomputed)
            check_decode_budget(decode_counts, new_tokens=len(generated[0]) - prompt.shape[1])
        return metrics

    return check
