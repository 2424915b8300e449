"""Forward passes on a rank for the driver: logits, whole generations, or generations one step at a time (SPEC INF-1).

Every rank of a tp group computes the same rows with its shards; the first one answers. Ranks
with different rows still share collectives at every forward (FSDP gathers, expert all-to-alls),
so under data or expert parallelism they take the same number of steps: a rank whose rows all
finished keeps stepping (writing pad ids) until the request's last step. A stream keeps its
:class:`~raymoe.models.common.generation.Generation` in ``ctx.loaded.generation`` between calls.

A generation (and a stream, from its start to its end) gathers each FSDP unit once and keeps the full
weights through every step (``raymoe.parallel.fsdp.keep_unsharded``), then reshards. The host waits for the
device once per decoded token at most: the ``done`` check of :func:`generate_tokens` (none where ranks step
together), the token :func:`stream_step` answers; the answer itself is one copy to the host.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from raymoe.models.common.decoder import CausalLM
from raymoe.models.common.generation import Generation
from raymoe.models.common.transfer import to_device
from raymoe.parallel.fsdp import keep_unsharded, release_unsharded, reshard
from raymoe.rank.context import RankContext
from raymoe.rank.contract import DecodeRequest
from raymoe.rank.routes import assemble_routes, start_keeping, take_from_parts
from raymoe.spec.topology import Axis


@torch.no_grad()
def forward_logits(
    ctx: RankContext,
    input_ids_BS: Tensor,
    attention_mask_BS: Tensor | None = None,
    last_only: bool = False,
    document_ids_BS: Tensor | None = None,
) -> Tensor | None:
    """``logits [B_local, S, V]`` (``[B_local, V]`` at each row's last real token with ``last_only``) on CPU,
    from the answering rank of each batch; None elsewhere (same rows). ``document_ids``: packed rows.

    Under context parallelism each cp rank computes its share of the rows' logits and they are gathered on the
    answering rank; a forward that cannot be split (``last_only``, a padding mask, a length that does not cut into
    ``2 * cp_size`` chunks) runs on the whole rows on every cp rank."""
    loaded = ctx.require_model()
    mask = to_device(attention_mask_BS, ctx.device) if attention_mask_BS is not None else None
    documents = to_device(document_ids_BS, ctx.device) if document_ids_BS is not None else None
    last_B = to_device(_last_real(input_ids_BS, attention_mask_BS), ctx.device) if last_only else None
    shares = loaded.shares.for_inference(input_ids_BS.shape[1], padded=mask is not None or last_only)
    split = shares.context
    for part in loaded.parts:
        part.eval()

    def run(part: CausalLM, inputs: Tensor) -> Tensor:
        out: Tensor = part(inputs, None, mask, last_B, documents)
        return out

    with shares.applied(loaded.parts):
        logits = loaded.runner.forward(ctx, input_ids_BS, run)
    for part in loaded.parts:
        reshard(part)
    if logits is None:
        return None
    if isinstance(logits, DTensor):
        logits = logits.full_tensor()
    if split is not None:
        if ctx.coords.tp > 0:  # its tp group's first rank's cp group gathers the same logits
            return None
        logits = split.gather_to_first(logits)
    return logits.cpu() if ctx.answers_for_batch and logits is not None else None


def _last_real(input_ids_BS: Tensor, attention_mask_BS: Tensor | None) -> Tensor:
    """``[B]`` the index of each row's last real token."""
    width = input_ids_BS.shape[1]
    if attention_mask_BS is None:
        return torch.full((input_ids_BS.shape[0],), width - 1)
    return width - 1 - attention_mask_BS.flip(1).int().argmax(dim=1)


@torch.no_grad()
def generate_tokens(
    ctx: RankContext, input_ids_BS: Tensor, attention_mask_BS: Tensor | None, row_ids: Tensor, request: DecodeRequest
) -> tuple[Tensor, ...] | None:
    """``(tokens [B_local, S + n], lengths [B_local])`` (n <= max_new_tokens) from the first rank of each tp group.

    ``lengths``: tokens each row generated up to its stop token, -1 for a row that never stopped. With
    ``request.keep_routes`` a third entry, ``routes [B_local, S + n, L_moe, K]`` int16: the experts each token's
    forward chose (the last token is fed once more, after the last step, for its own).
    """
    loaded = ctx.require_model()
    generation = _start(ctx, input_ids_BS, attention_mask_BS, row_ids, request)
    in_step = _in_step(ctx)
    steps: list[dict[int, Tensor]] = []
    start_keeping(loaded.parts, request.keep_routes)
    try:
        while generation.steps < request.max_new_tokens:
            width = generation.prompt_length if generation.steps == 0 else 1
            generation.step()
            if request.keep_routes:
                steps.append(take_from_parts(loaded.parts, input_ids_BS.shape[0], width))
            if not in_step and generation.done:
                break
        if request.keep_routes:
            width = generation.prompt_length if generation.steps == 0 else 1
            generation.feed_newest()
            steps.append(take_from_parts(loaded.parts, input_ids_BS.shape[0], width))
    finally:
        start_keeping(loaded.parts, False)
        _release(ctx)
    routes = _step_routes(ctx, steps) if request.keep_routes else None
    if not ctx.answers_for_batch:
        return None
    tokens_BL = generation.result()
    host = torch.cat([tokens_BL, generation.lengths_B[:, None].to(tokens_BL.dtype)], dim=1).cpu()  # one copy
    if routes is not None:
        return host[:, :-1].contiguous(), host[:, -1].to(torch.int64), routes
    return host[:, :-1].contiguous(), host[:, -1].to(torch.int64)


def _step_routes(ctx: RankContext, steps: list[dict[int, Tensor]]) -> Tensor | None:
    """Each step's ``{slot: [B, s, K]}`` joined along the tokens: ``[B, S + n, L_moe, K]`` on the answering rank."""
    slots = sorted(steps[0]) if steps else []
    joined = {slot: torch.cat([step[slot] for step in steps], dim=1) for slot in slots}
    return assemble_routes(ctx, joined, len(ctx.require_model().spec.config.sparse_slots()))


def start_stream(
    ctx: RankContext, input_ids_BS: Tensor, attention_mask_BS: Tensor | None, row_ids: Tensor, request: DecodeRequest
) -> None:
    """Keep a generation of this rank's rows for :func:`stream_step` (replacing an unfinished one)."""
    loaded = ctx.require_model()
    loaded.generation = None
    _release(ctx)
    loaded.generation = _start(ctx, input_ids_BS, attention_mask_BS, row_ids, request)


@torch.no_grad()
def stream_step(ctx: RankContext) -> tuple[Tensor, Tensor] | None:
    """One step of the kept generation: ``(next tokens [B_local], finished [B_local])`` from the answering rank."""
    loaded = ctx.require_model()
    if loaded.generation is None:
        raise RuntimeError("stream_step without start_stream: no generation on this rank")
    next_B = loaded.generation.step()
    if not ctx.answers_for_batch:
        return None
    host = torch.stack([next_B, loaded.generation.finished_B.to(next_B.dtype)]).cpu()  # the step's one sync
    return host[0], host[1].bool()


def end_stream(ctx: RankContext) -> None:
    """Drop the kept generation and its KV cache."""
    ctx.require_model().generation = None
    _release(ctx)


def _start(
    ctx: RankContext, input_ids_BS: Tensor, attention_mask_BS: Tensor | None, row_ids: Tensor, request: DecodeRequest
) -> Generation:
    """A generation of this rank's rows, every FSDP unit gathered until :func:`_release`."""
    loaded = ctx.require_model()
    try:
        for part in loaded.parts:
            part.eval()
            keep_unsharded(part)
        return Generation(
            loaded.runner.decoder(ctx),
            to_device(input_ids_BS, ctx.device),
            request.max_new_tokens,
            attention_mask_BS=to_device(attention_mask_BS, ctx.device) if attention_mask_BS is not None else None,
            sampling=request.sampling,
            stop=request.stop,
            row_ids=row_ids.tolist(),  # a host tensor: no device to wait for
            spare_positions=1 if request.keep_routes else 0,
        )
    except BaseException:
        _release(ctx)
        raise


def _release(ctx: RankContext) -> None:
    """Every part resharded, each FSDP unit back to its own reshard-after-forward setting."""
    for part in ctx.require_model().parts:
        release_unsharded(part)


def _in_step(ctx: RankContext) -> bool:
    """Ranks with different rows share collectives at every step (FSDP gathers, expert all-to-alls); the stages
    of a pipeline are all in every step."""
    return ctx.topology.config.dp_size > 1 or ctx.topology.axis_size(Axis.EP) > 1
