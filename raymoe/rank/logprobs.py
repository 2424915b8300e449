"""Per-token log-probabilities on a rank for the driver (RL): ``[B, S]`` aligned with the tokens, computed where the
logits are, vocabulary-parallel under TP (no ``[B, S, V]`` tensor gathered), with entropies and routes on request.

Every rank of a batch runs its rows (the forward's collectives need all of them); the answering rank of each
batch returns ``(logprobs, entropy or None, routes or None)`` on CPU.
"""

from __future__ import annotations

import torch
from torch import Tensor

from raymoe.models.common.decoder import CausalLM
from raymoe.models.common.logprobs import next_token_entropy, next_token_logprobs
from raymoe.models.common.transfer import to_device
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
    rows from the answering rank of the batch; None elsewhere. ``routes`` given: the routers replay them."""
    loaded = ctx.require_model()
    device = ctx.device
    mask = to_device(attention_mask_BS, device) if attention_mask_BS is not None else None
    documents = to_device(document_ids_BS, device) if document_ids_BS is not None else None
    routes = to_device(routes_BSLK, device) if routes_BSLK is not None else None
    for part in loaded.parts:
        part.eval()
    start_keeping(loaded.parts, request.return_routes)

    def run(part: CausalLM, inputs: Tensor) -> Tensor:
        out: Tensor = part(inputs, None, mask, None, documents, routes)
        return out

    try:
        answer: tuple[Tensor, Tensor | None] | None = None
        with vocab_parallel_loss(loaded.parts[-1]):
            logits = loaded.runner.forward(ctx, input_ids_BS, run)
            if logits is not None:
                ids = to_device(input_ids_BS, device)
                logprobs = whole(next_token_logprobs(logits, ids, request.temperature))
                entropy = whole(next_token_entropy(logits, request.temperature)) if request.return_entropy else None
                answer = (logprobs, entropy)
            del logits
        kept = take_from_parts(loaded.parts, *input_ids_BS.shape) if request.return_routes else {}
    finally:
        start_keeping(loaded.parts, False)
        for part in loaded.parts:
            reshard(part)
    routes_out = assemble_routes(ctx, kept, request.num_slots) if request.return_routes else None
    if answer is None or not ctx.answers_for_batch:
        return None
    logprobs, entropy = answer
    return logprobs.cpu(), entropy.cpu() if entropy is not None else None, routes_out
