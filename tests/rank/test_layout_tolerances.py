"""The layout check's bounds (``check_layout`` in tests/rank/conftest.py) against the errors they are there to catch.

A bound must sit between the rounding by which two correct layouts differ (1.01e-5 at most on the trained weights,
measured there) and the smallest error a wrong layout makes. Errors are planted in one parameter of transformers'
own run of the check's reference (one process, AdamW, the check's data and steps) on the tiny Qwen3-MoE::

    planted in the first layer's q_proj                 its trained weight (norm-relative)    caught by
    trained without weight decay                        STEPS * LR * WEIGHT_DECAY = 3e-4      the weights (15x)
    its gradient halved for one step                    ~1e-2                                 the weights
    its gradient halved at every step                   ~9e-6: AdamW divides the scale out    the gradient norm

A gradient off by the same factor at every step (a mean over ranks where a sum belongs, on every step) leaves
AdamW's updates as they were, up to its epsilon: the weights cannot show it, so the check holds each step's
gradient norm to ``metric_rtol`` too. No Ray: one process, a fraction of a second a run.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch

MODEL = "moe_e8_k2_mha"
PLANTED = "model.layers.0.self_attn.q_proj.weight"
MARGIN = 10  # a bound that only just catches an error here would miss it where the error is smaller


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return (torch.linalg.vector_norm(actual - expected) / torch.linalg.vector_norm(expected)).item()


def train(
    hf_model, data, run, *, decay: bool = True, scale: Callable[[int], float] = lambda step: 1.0
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The check's reference run (conftest ``reference_training``) with an error planted in :data:`PLANTED`:
    trained without weight decay (``decay=False``), or its gradient times ``scale(step)`` after backward.
    -> (each step's gradient norm, the trained parameters)."""
    model = copy.deepcopy(hf_model).train()
    params = dict(model.named_parameters())
    groups = [{"params": [p for name, p in params.items() if decay or name != PLANTED]}]
    if not decay:
        groups.append({"params": [params[PLANTED]], "weight_decay": 0.0})
    optimizer = torch.optim.AdamW(groups, lr=run.lr, weight_decay=run.weight_decay)
    norms = []
    for step, (ids, mask) in enumerate(data):
        model(input_ids=ids, labels=ids.masked_fill(mask == 0, -100)).loss.backward()
        params[PLANTED].grad.mul_(scale(step))
        norms.append(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item())
        optimizer.step()
        optimizer.zero_grad()
    return norms, {name: p.detach() for name, p in params.items()}


@pytest.fixture(scope="module")
def reference(tiny_checkpoint, load_hf_model, layout_reference, layout_check_run):
    """``(hf_model, data, norms, trained parameters)``: the reference run the layout checks compare with."""
    directory = tiny_checkpoint(MODEL)
    data, _, norms, trained = layout_reference(directory, layout_check_run.seq)
    return load_hf_model(directory), data, norms, {name: p.detach() for name, p in trained.named_parameters()}


def test_the_planting_run_without_an_error_is_the_reference_run(reference, layout_check_run):
    hf_model, data, ref_norms, ref_trained = reference
    norms, trained = train(hf_model, data, layout_check_run)
    assert norms == ref_norms
    assert all(torch.equal(trained[name], ref_trained[name]) for name in ref_trained)


@pytest.mark.parametrize(
    "planted",
    [
        pytest.param({"decay": False}, id="trained_without_weight_decay"),
        pytest.param({"scale": lambda step: 0.5 if step == 1 else 1.0}, id="gradient_halved_for_one_step"),
    ],
)
def test_the_weight_bound_catches_a_wrong_update_of_one_parameter(reference, layout_check_run, planted):
    hf_model, data, _, ref_trained = reference
    _, trained = train(hf_model, data, layout_check_run, **planted)
    assert rel_error(trained[PLANTED], ref_trained[PLANTED]) >= MARGIN * layout_check_run.weight_rtol


def test_a_gradient_off_by_one_factor_at_every_step_is_left_to_the_gradient_norm(reference, layout_check_run):
    hf_model, data, ref_norms, ref_trained = reference
    norms, trained = train(hf_model, data, layout_check_run, scale=lambda step: 0.5)
    # AdamW divides the gradient's scale out of its update: the trained weights stay within the weight bound ...
    assert rel_error(trained[PLANTED], ref_trained[PLANTED]) < layout_check_run.weight_rtol
    # ... and each step's gradient norm is far outside its own
    for norm, ref_norm in zip(norms, ref_norms, strict=True):
        assert abs(norm - ref_norm) >= MARGIN * layout_check_run.metric_rtol * ref_norm
