"""The loss a training micro-batch back-propagates: next-token cross-entropy, or a policy loss (RL).

    cross-entropy   loss_sum = summed token loss of the labels                      stats: none
    built-in policy loss_sum = sum(weights * (pg + kl_coef * kl))  (raymoe.models.common.policy_loss)
                    stats [4] = sum(weights * pg), sum(weights * kl), clipped tokens, sum of approx-KL
    callable        (loss_sum, normalizer) = fn(logprobs, fields)                   stats [1] = normalizer

The loss reads one *target* tensor, aligned with the logits: entry ``t`` is about the token position ``t`` predicts
(``t + 1``), so a rank that holds a share of every row (context parallelism) cuts it like its tokens and needs
nothing from the other shares (:func:`micro_target`)::

    cross-entropy   [B, S]       the next token's label (-100: no loss)
    built-in policy [B, S, 1+F]  float64: the next token's id, then its per-token fields (``weights`` ...)
    callable        [B, S, 1+F]  float64: the tokens' own ids and fields (it gets log-probs aligned with the tokens;
                                 refused with context parallelism, where a rank has no whole rows)

``weights [B, S]`` (from the driver, :mod:`raymoe.driver.policy`) hold the aggregation: zero where a token
takes no loss. The caller divides ``loss_sum`` by the global normalizer (built-ins) or scales the gradients
after the step's backward (a callable). Under pipeline parallelism the last stage gets the target from the schedule,
which cuts it into pieces with the rows.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor, nn

from raymoe.models.common.logprobs import next_token_logprobs, target_logprobs
from raymoe.models.common.loss import IGNORE_INDEX, next_in_row, token_loss
from raymoe.models.common.policy_loss import policy_terms
from raymoe.models.common.transfer import to_device
from raymoe.parallel.context_parallel.split import ContextSplit
from raymoe.parallel.vocab_parallel import whole
from raymoe.rank.contract import MicroBatch
from raymoe.spec.policy import PolicyLoss

# The per-token inputs of a policy micro-batch, in the order micro_target stacks them after the token ids.
FIELD_ORDER = ("weights", "advantages", "old_logprobs", "ref_logprobs")


def micro_objective(
    model: nn.Module,
    micro: MicroBatch,
    device: torch.device,
    policy: PolicyLoss | None,
    split: ContextSplit | None = None,
) -> tuple[Tensor, Tensor | None]:
    """``(loss_sum, stats)`` of ``micro``'s rows (this rank's share of them under ``split``, whose forward the
    caller has set up), with the graph to back-propagate ``loss_sum`` (float32).

    No reference to the logits ``[B, S, V]`` outlives this call: the loss's graph keeps only their log-softmax,
    so the logits are freed before backward (one vocabulary-wide tensor less at the step's peak)."""
    documents = to_device(micro.document_ids, device) if micro.document_ids is not None else None
    routes = to_device(micro.routes, device) if micro.routes is not None else None
    logits = model(to_device(micro.input_ids, device), document_ids_BS=documents, routes_BSLK=routes)
    target = to_device(micro_target(micro, policy, split), device)
    result = target_objective(logits, target, policy, field_names(micro))
    del logits
    return result


def micro_target(micro: MicroBatch, policy: PolicyLoss | None, split: ContextSplit | None = None) -> Tensor:
    """What the loss of ``micro`` reads besides the logits (see the module docstring), cut to ``split``'s share."""
    if policy is not None and policy.is_callable:
        if split is not None:
            raise ValueError("a callable policy loss gets whole rows of log-probs; it does not run with cp_size > 1")
        fields = micro.fields or {}
        columns = [micro.input_ids.double()] + [fields[name].double() for name in FIELD_ORDER if name in fields]
        return torch.stack(columns, dim=-1)
    if policy is None:
        target = next_in_row(micro.labels, IGNORE_INDEX)
    else:
        fields = micro.fields or {}
        columns = [next_in_row(micro.input_ids, IGNORE_INDEX).double()]
        columns += [next_in_row(fields[name].double(), 0.0) for name in FIELD_ORDER if name in fields]
        target = torch.stack(columns, dim=-1)
    return split.cut(target) if split is not None else target


def target_objective(
    logits_BSV: Tensor, target: Tensor, policy: PolicyLoss | None, names: tuple[str, ...]
) -> tuple[Tensor, Tensor | None]:
    """``(loss_sum, stats)`` of logits (possibly vocabulary-sharded) against :func:`micro_target`'s ``target``
    (on the logits' device; ``names``: the fields it stacks)."""
    if policy is None:
        loss: Tensor = whole(token_loss(logits_BSV, target, reduction="sum"))
        return loss, None
    ids, fields = target[..., 0].long(), {name: target[..., 1 + i].float() for i, name in enumerate(names)}
    if policy.fn is not None:
        return _callable_objective(logits_BSV, ids, fields, policy)
    logprobs_BS = whole(target_logprobs(logits_BSV, ids, policy.temperature))
    return policy_objective(logprobs_BS, fields, policy)


def policy_objective(logprobs_BS: Tensor, fields: Mapping[str, Tensor], policy: PolicyLoss) -> tuple[Tensor, Tensor]:
    """A built-in policy loss of per-token ``logprobs`` and the ``fields`` of the same tokens: ``(loss_sum, stats)``."""
    weights_BS = fields["weights"]
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


def _callable_objective(
    logits_BSV: Tensor, input_ids_BS: Tensor, fields: Mapping[str, Tensor], policy: PolicyLoss
) -> tuple[Tensor, Tensor]:
    """A user's loss callable, on log-probs and fields aligned with the tokens of whole rows."""
    assert policy.fn is not None
    logprobs_BS = whole(next_token_logprobs(logits_BSV, input_ids_BS, policy.temperature))
    weights_BS = fields["weights"]
    given = {name: fields[name] for name in FIELD_ORDER[1:] if name in fields}
    user_fields = {"input_ids": input_ids_BS, "loss_mask": (weights_BS != 0).float(), **given}
    loss_sum, normalizer = policy.fn(logprobs_BS, user_fields)
    if not isinstance(loss_sum, Tensor) or loss_sum.dim() != 0:
        raise ValueError("train_step: the loss callable must return (loss_sum: a 0-d tensor, normalizer)")
    return loss_sum.float(), torch.as_tensor(normalizer, dtype=torch.float64, device=logprobs_BS.device)[None]


def field_names(micro: MicroBatch) -> tuple[str, ...]:
    """The fields :func:`micro_target` stacks for ``micro``, in order."""
    fields = micro.fields or {}
    return tuple(name for name in FIELD_ORDER if name in fields)
