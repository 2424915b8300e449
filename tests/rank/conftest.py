"""The layout check every family's multi-rank tests share: train a few steps on the shared world, compare with
transformers in one process, save, reload in transformers."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from ray import cloudpickle

cloudpickle.register_pickle_by_value(sys.modules[__name__])

LR, WEIGHT_DECAY, STEPS, ROWS, SEQ = 1e-3, 0.1, 3, 8, 10
MICRO = 2  # micro-batches of the counted step


def counted_step(ctx, vocab: int, seq: int = SEQ) -> tuple[int, int, int, int, dict[str, int]]:
    """A training step of ``MICRO`` micro-batches (the same rows on every rank) under the meter
    (:func:`_budget_parts`); the second of two where a first step of a new shape sets something up (a pipeline's
    schedule, compiled blocks' graphs), else the layout test's steps before it were the warm-up."""
    import torch

    from raymoe.parallel.compiled_blocks import is_compiled
    from raymoe.rank.contract import MicroBatch
    from raymoe.rank.host_syncs import HostSyncs
    from raymoe.rank.train import train_step

    ids = torch.randint(0, vocab, (ROWS, seq), generator=torch.Generator().manual_seed(0))
    micro = MicroBatch(ids, ids.clone(), torch.ones_like(ids, dtype=torch.bool))
    tokens = MICRO * ids.numel() * ctx.topology.world_size
    model = ctx.require_model()
    if ctx.topology.config.pp_size > 1 or any(is_compiled(part) for part in model.parts):
        train_step(ctx, [micro] * MICRO, global_tokens=tokens)
    with HostSyncs() as syncs:
        train_step(ctx, [micro] * MICRO, global_tokens=tokens)
    return _budget_parts(ctx, syncs)


def dynamo_graphs(ctx) -> int:
    """Graphs dynamo compiled in this rank's process so far (its counters add up over every load)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def counted_decode(ctx, vocab: int, new_tokens: int) -> tuple[int, int, int, int, dict[str, int]]:
    """``generate_tokens`` of ``new_tokens`` steps (sampling; stop rules that stop nothing, so every rank steps them
    all) under the meter (:func:`_budget_parts`)."""
    import torch

    from raymoe.models.common.generation import SamplingConfig, StopRules
    from raymoe.rank.contract import DecodeRequest
    from raymoe.rank.host_syncs import HostSyncs
    from raymoe.rank.infer import generate_tokens

    ids = torch.randint(1, vocab, (2, 6), generator=torch.Generator().manual_seed(0))
    request = DecodeRequest(new_tokens, SamplingConfig(do_sample=True, seed=3), StopRules(eos_ids=(), pad_id=0))
    with HostSyncs() as syncs:
        generate_tokens(ctx, ids, None, torch.arange(2), request)
    return _budget_parts(ctx, syncs)


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


def check_sync_budgets(model, vocab: int, seq: int = SEQ) -> None:
    """The sync budgets (issue 36) of a training step: one device -> host sync (the step's answer), plus under token
    dispatch the all-to-all split sizes, one per MoE layer and micro-batch (again in recomputation); and of
    decoding: one per token (plus one read of the rows' host ids when it starts, which the CPU meter counts), plus
    the split sizes at each forward. The padded GEMM fallback's reads are granted too (:func:`_budget_parts`)."""
    recomputed = 2 if model.topology.config.activation_checkpointing != "none" else 1
    for syncs, dispatch, fallback, moe_layers, sites in model.run_on_ranks(counted_step, vocab, seq):
        assert syncs - dispatch - fallback <= 1, sites
        assert dispatch in (0, moe_layers * MICRO * recomputed), sites
    new_tokens = 3  # the prompt and two one-token steps: a sync per token or per forward more shows
    for syncs, dispatch, fallback, moe_layers, sites in model.run_on_ranks(counted_decode, vocab, new_tokens):
        assert syncs - dispatch - fallback <= new_tokens + 1, sites
        assert dispatch in (0, moe_layers * new_tokens), sites


TORCH_BETAS = (0.9, 0.999)  # the reference runs torch.optim.AdamW with its defaults, no clipping


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return (torch.linalg.vector_norm(actual - expected) / torch.linalg.vector_norm(expected).clamp_min(1e-12)).item()


@pytest.fixture
def check_layout(
    load_on_world, tiny_checkpoint, load_hf_model, reference_training, padded_batches
) -> Callable[..., list[dict[str, Any]]]:
    """``check_layout(config, tmp_path, checkpoint=name or directory, micro_batches=1, zero_gradient=(), seq=10,
    **from_pretrained options)`` -> the step metrics.

    Three AdamW steps on padded batches under ``config``: each loss and gradient norm within 1e-5 (relative)
    of transformers training on the whole global batch in one process; the saved checkpoint loads in
    transformers with every weight within 1e-5 of the reference's, and gives the handle's logits (1e-5) and its
    greedy continuation of one prompt. ``zero_gradient`` names (suffixes) the parameters whose exact gradient is
    zero, a key bias under softmax attention without sinks (it shifts all of a query's scores alike): AdamW turns
    their rounding noise into moves of up to lr a step, different under every layout, so they are held to that bound.
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
        hf_model = load_hf_model(directory)
        data = padded_batches(hf_model.config.vocab_size, steps=STEPS, rows=ROWS, seq=seq)
        ref_losses, ref_norms, ref_model = reference_training(hf_model, data, LR, WEIGHT_DECAY)
        with load_on_world(directory, config, **load_options) as model:
            model.configure_training(lr=LR, weight_decay=WEIGHT_DECAY, betas=TORCH_BETAS, max_grad_norm=None)
            graphs_before = model.run_on_ranks(dynamo_graphs)
            metrics = [model.train_step(ids, attention_mask=mask, micro_batches=micro_batches) for ids, mask in data]
            if load_options.get("compile"):  # the steps ran compiled graphs, each rank's own, not eager code
                after = model.run_on_ranks(dynamo_graphs)
                assert all(a > b for a, b in zip(after, graphs_before, strict=True)), (graphs_before, after)
            for step, (got, want, norm) in enumerate(zip(metrics, ref_losses, ref_norms, strict=True)):
                assert abs(got["loss"] - want) <= 1e-5 * abs(want), (step, got["loss"], want)
                # the gradient norm spans both meshes, dense and expert (SPEC TRAIN-2)
                assert abs(got["grad_norm"] - norm) <= 1e-5 * norm, (step, got["grad_norm"], norm)
            model.save_pretrained(tmp_path)
            trained = load_hf_model(tmp_path)
            reference = dict(ref_model.named_parameters())
            for name, param in trained.named_parameters():
                if name.endswith(zero_gradient):
                    assert (param - reference[name]).abs().max().item() <= 2 * STEPS * LR, name
                    continue
                assert rel_error(param, reference[name].detach()) <= 1e-5, name
            ids = data[0][0]
            with torch.no_grad():
                assert (model(ids) - trained(input_ids=ids).logits).abs().max().item() <= 1e-5
            # one prompt on any layout (idle data-parallel batches decode a copy and are dropped)
            prompt = ids[:1, :6]
            expected = trained.generate(
                prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4, do_sample=False
            )
            assert model.generate(prompt[0:1].tolist(), 4) == [expected[0].tolist()]
            check_sync_budgets(model, vocab=hf_model.config.vocab_size, seq=seq)
        return metrics

    return check
