"""The loss a training micro-batch back-propagates: next-token cross-entropy, or a policy loss (RL).

    cross-entropy   loss_sum = summed token loss of the labels                      stats: none
    built-in policy loss_sum = sum(weights * (pg + kl_coef * kl))  (raymoe.models.common.policy_loss)
                    stats [4] = sum(weights * pg), sum(weights * kl), clipped tokens, sum of approx-KL
    callable        (loss_sum, normalizer) = fn(logprobs, fields)                   stats [1] = normalizer

``weights [B, S]`` (from the driver, :mod:`raymoe.driver.policy`) hold the aggregation: zero where a token
takes no loss. The caller divides ``loss_sum`` by the global normalizer (built-ins) or scales the gradients
after the step's backward (a callable). Under pipeline parallelism the last stage gets the per-token inputs
as one float64 ``target [B, S, F]`` (:func:`pack_target`), which the schedule cuts into pieces with the rows.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor, nn

from raymoe.models.common.logprobs import next_token_logprobs
from raymoe.models.common.loss import causal_lm_loss
from raymoe.models.common.policy_loss import policy_terms
from raymoe.models.common.transfer import to_device
from raymoe.parallel.vocab_parallel import whole
from raymoe.rank.contract import MicroBatch
from raymoe.spec.policy import PolicyLoss

# The per-token inputs of a policy micro-batch, in the order pack_target stacks them after the token ids.
FIELD_ORDER = ("weights", "advantages", "old_logprobs", "ref_logprobs")


def micro_objective(
    model: nn.Module, micro: MicroBatch, device: torch.device, policy: PolicyLoss | None
) -> tuple[Tensor, Tensor | None]:
    """``(loss_sum, stats)`` of ``micro``'s rows, with the graph to back-propagate ``loss_sum`` (float32).

    No reference to the logits ``[B, S, V]`` outlives this call: the loss's graph keeps only their log-softmax,
    so the logits are freed before backward (one vocabulary-wide tensor less at the step's peak)."""
    documents = to_device(micro.document_ids, device) if micro.document_ids is not None else None
    routes = to_device(micro.routes, device) if micro.routes is not None else None
    ids = to_device(micro.input_ids, device)
    logits = model(ids, document_ids_BS=documents, routes_BSLK=routes)
    if policy is None:
        loss: Tensor = whole(causal_lm_loss(logits, to_device(micro.labels, device), reduction="sum"))
        return loss, None
    fields = {name: to_device(value, device) for name, value in (micro.fields or {}).items()}
    result = logits_objective(logits, ids, fields, policy)
    del logits
    return result


def logits_objective(
    logits_BSV: Tensor, input_ids_BS: Tensor, fields: Mapping[str, Tensor], policy: PolicyLoss
) -> tuple[Tensor, Tensor]:
    """A policy loss of logits (possibly vocabulary-sharded) and the per-token ``fields`` (``weights`` and the
    loss's inputs, ``[B, S]`` on the logits' device): ``(loss_sum, stats)``, see the module docstring."""
    logprobs_BS = whole(next_token_logprobs(logits_BSV, input_ids_BS, policy.temperature))
    weights_BS = fields["weights"]
    if policy.fn is not None:
        given = {name: fields[name] for name in FIELD_ORDER[1:] if name in fields}
        user_fields = {"input_ids": input_ids_BS, "loss_mask": (weights_BS != 0).float(), **given}
        loss_sum, normalizer = policy.fn(logprobs_BS, user_fields)
        if not isinstance(loss_sum, Tensor) or loss_sum.dim() != 0:
            raise ValueError("train_step: the loss callable must return (loss_sum: a 0-d tensor, normalizer)")
        return loss_sum.float(), torch.as_tensor(normalizer, dtype=torch.float64, device=logprobs_BS.device)[None]
    mask_BS = weights_BS != 0
    # Off the loss tokens every field is 0 (the driver's): 0 log-probs there make each term exactly 0 (ratio 1,
    # k3 0) instead of exp(-logprob) overflowing into 0 * inf.
    logprobs_BS = torch.where(mask_BS, logprobs_BS, torch.zeros((), device=logprobs_BS.device))
    terms = policy_terms(
        logprobs_BS,
        fields["old_logprobs"],
        fields["advantages"],
        fields.get("ref_logprobs"),
        clipped=policy.kind == "ppo",
        clip_low=policy.clip_low,
        clip_high=policy.upper_clip,
        clip_c=policy.clip_c,
    )
    per_token_BS = terms.pg + policy.kl_coef * terms.kl if policy.kl_coef > 0 else terms.pg
    loss_sum = (weights_BS * per_token_BS).sum()
    stats = torch.stack(
        [
            (weights_BS * terms.pg).sum(),
            (weights_BS * terms.kl).sum(),
            terms.clipped[mask_BS].sum(),
            terms.approx_kl[mask_BS].sum(),
        ]
    )
    return loss_sum, stats.detach().double()


def pack_target(micro: MicroBatch, policy: PolicyLoss | None) -> Tensor:
    """What a pipeline's last stage gets as ``target``: the labels (cross-entropy), or the token ids and every
    per-token field as float64 ``[B, S, 1 + F]`` (ids below 2**53 are exact), fields in ``FIELD_ORDER``."""
    if policy is None:
        return micro.labels
    fields = micro.fields or {}
    columns = [micro.input_ids.double()] + [fields[name].double() for name in FIELD_ORDER if name in fields]
    return torch.stack(columns, dim=-1)


def unpack_target(target: Tensor, names: tuple[str, ...]) -> tuple[Tensor, dict[str, Tensor]]:
    """:func:`pack_target`'s inverse: ``(input_ids [B, S] int64, {name: [B, S] float32})``."""
    fields = {name: target[..., 1 + i].float() for i, name in enumerate(names)}
    return target[..., 0].long(), fields


def field_names(micro: MicroBatch) -> tuple[str, ...]:
    """The fields :func:`pack_target` stacked for ``micro``, in order."""
    fields = micro.fields or {}
    return tuple(name for name in FIELD_ORDER if name in fields)
