"""Per-token log-probabilities on a rank for the driver (RL): ``[B, S]`` aligned with the tokens, computed where the
logits are, vocabulary-parallel under TP (no ``[B, S, V]`` tensor gathered), with entropies and routes on request.

Every rank of a batch runs its rows (the forward's collectives need all of them); the answering rank of each
batch returns ``(logprobs, entropy or None, routes or None)`` on CPU.
"""

from __future__ import annotations

import torch
from torch import Tensor

from raymoe.models.common.decoder import CausalLM
from raymoe.models.common.logprobs import predicted_entropy, target_logprobs, to_token_alignment
from raymoe.models.common.loss import IGNORE_INDEX, next_in_row
from raymoe.models.common.transfer import to_device
from raymoe.parallel.context_parallel.split import ContextSplit
from raymoe.parallel.fsdp import reshard
from raymoe.parallel.vocab_parallel import vocab_parallel_loss, whole
from raymoe.rank.context import RankContext
from raymoe.rank.contract import LogprobRequest
from raymoe.rank.routes import assemble_routes, start_keeping, take_from_parts


@torch.no_grad()
def token_logprobs(
    ctx: RankContext,
    input_ids_BS: Tensor,
    attention_mask_BS: Tensor | None,
    document_ids_BS: Tensor | None,
    routes_BSLK: Tensor | None,
    request: LogprobRequest,
) -> tuple[Tensor, Tensor | None, Tensor | None] | None:
    """``(logprobs [B, S] float32, entropy [B, S] | None, routes [B, S, L_moe, K] int16 | None)`` of this rank's
    rows from the answering rank of the batch; None elsewhere. ``routes`` given: the routers replay them.

    Under context parallelism each cp rank computes its share (aligned with the positions that predict, so no
    share needs another's next token) and the shares are gathered, then aligned with the tokens; a forward that
    cannot be split runs on the whole rows on every cp rank (:meth:`SequenceShares.for_inference`)."""
    loaded = ctx.require_model()
    device = ctx.device
    mask = to_device(attention_mask_BS, device) if attention_mask_BS is not None else None
    documents = to_device(document_ids_BS, device) if document_ids_BS is not None else None
    routes = to_device(routes_BSLK, device) if routes_BSLK is not None else None
    shares = loaded.shares.for_inference(input_ids_BS.shape[1], padded=mask is not None)
    split = shares.context
    for part in loaded.parts:
        part.eval()
    start_keeping(loaded.parts, request.return_routes)

    def run(part: CausalLM, inputs: Tensor) -> Tensor:
        out: Tensor = part(inputs, None, mask, None, documents, routes)
        return out

    try:
        answer: tuple[Tensor, Tensor | None] | None = None
        with vocab_parallel_loss(loaded.parts[-1]), shares.applied(loaded.parts):
            logits = loaded.runner.forward(ctx, input_ids_BS, run)
            if logits is not None:
                targets = next_in_row(input_ids_BS, IGNORE_INDEX)
                targets = to_device(split.cut(targets) if split is not None else targets, device)
                logprobs = whole(target_logprobs(logits, targets, request.temperature))
                entropy = whole(predicted_entropy(logits, request.temperature)) if request.return_entropy else None
                answer = (logprobs, entropy)
            del logits
        width = split.local_length(input_ids_BS.shape[1]) if split is not None else input_ids_BS.shape[1]
        kept = take_from_parts(loaded.parts, input_ids_BS.shape[0], width) if request.return_routes else {}
    finally:
        start_keeping(loaded.parts, False)
        for part in loaded.parts:
            reshard(part)
    if split is not None:
        # int16 routes travel as int32: neither gloo nor NCCL reduces or gathers 16-bit integers
        answer, kept = _gathered(split, answer), {s: split.gather(ids.int()).to(ids.dtype) for s, ids in kept.items()}
    routes_out = assemble_routes(ctx, kept, request.num_slots) if request.return_routes else None
    if answer is None or not ctx.answers_for_batch:
        return None
    logprobs, entropy = answer
    aligned_entropy = to_token_alignment(entropy).cpu() if entropy is not None else None
    return to_token_alignment(logprobs).cpu(), aligned_entropy, routes_out


def _gathered(split: ContextSplit, answer: tuple[Tensor, Tensor | None] | None) -> tuple[Tensor, Tensor | None] | None:
    """Every cp rank's share of the log-probs (and entropies) in row order, on the cp group's first rank."""
    if answer is None:  # a rank without the last pipeline stage: its cp group has none either
        return None
    logprobs, entropy = answer
    whole_logprobs = split.gather_to_first(logprobs)
    whole_entropy = split.gather_to_first(entropy) if entropy is not None else None
    return None if whole_logprobs is None else (whole_logprobs, whole_entropy)
