"""The ring attention's block kernels on the device (issue 32), for ``gpu_check.py --parts context``.

Ring attention (``raymoe/parallel/context_parallel/ring.py``) runs each (query chunk, key chunk) block through a
fused SDPA kernel that returns its log-sum-exp, and the backward of a block through that kernel's backward given the
*merged* output and log-sum-exp. On CPU that is ``_scaled_dot_product_flash_attention_for_cpu`` (every CPU test runs
it); on CUDA ``_scaled_dot_product_efficient_attention`` (its log-sum-exp rows padded to a multiple of 32, grouped
kv heads repeated, an additive mask expanded to every head), which no test can run without a GPU. This part checks
those CUDA calls against attention computed in float64 on the CPU, block by block: output, log-sum-exp and the three
gradients, for a causal diagonal block, a whole block, a masked block (a sliding window and two documents, so some
rows see no key), grouped kv heads and value heads narrower than the query heads (MLA), in float32 and bfloat16;
and times one 8k x 8k causal block against ``F.scaled_dot_product_attention`` on the same inputs. Then (issue 33) the
kernel choice for grouped kv heads that a compiled decoder block folds in at trace time, against SDPA's own choice,
and ``grouped_attention`` compiled whole against eager.

    bash benchmarks/gpu_check.sh --parts context
    .venv/bin/python benchmarks/gpu_check.py --smoke --parts context     # CPU: the CPU kernels, same checks
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from raymoe.parallel.context_parallel.ring import Block, _kernel_backward, _kernel_forward

CASES = {
    # name: (query heads, kv heads, head dim, value dim, block kind)
    "causal diagonal": (8, 8, 64, 64, "causal"),
    "whole block": (8, 8, 64, 64, "whole"),
    "window + documents": (8, 8, 64, 64, "masked"),
    "grouped kv heads": (8, 2, 64, 64, "causal"),
    "MLA value heads": (8, 8, 96, 64, "whole"),
}
TOLERANCE = {torch.float32: 2e-3, torch.bfloat16: 5e-2}  # max abs error / max abs of the float64 value


def run_context(device: torch.device) -> dict[str, Any]:
    """Every case in float32 and bfloat16 (CPU: float32 only); the errors and whether each is within tolerance."""
    dtypes = [torch.float32, torch.bfloat16] if device.type == "cuda" else [torch.float32]
    rows = []
    for name, case in CASES.items():
        for dtype in dtypes:
            errors = _check(device, dtype, *case)
            ok = all(error <= TOLERANCE[dtype] for error in errors.values())
            rows.append({"case": name, "dtype": str(dtype).removeprefix("torch."), **errors, "ok": ok})
            figures = "  ".join(f"{key} {value:.1e}" for key, value in errors.items())
            print(f"  ring block {name:<20} {rows[-1]['dtype']:<9} {figures}{'' if ok else '  FAILED'}")
    timing = _time_block(device) if device.type == "cuda" else None
    grouped = _compiled_grouped_attention(device)
    ok = all(row["ok"] for row in rows) and all(row["ok"] for row in grouped)
    return {"cases": rows, "compiled_grouped_attention": grouped, "all_ok": ok, "timing": timing}


def _compiled_grouped_attention(device: torch.device) -> list[dict[str, Any]]:
    """Grouped kv heads inside a compiled block (issue 33): the kernel choice a compiled block folds in at trace time
    (``sdpa_choice.choice_for_traits``, asked of fake tensors) against SDPA's own choice on the real tensors
    (CUDA only: on CPU the compiled block does not ask), and ``grouped_attention`` compiled whole (``fullgraph``, no
    graph break) against eager, for a masked and a causal call in each dtype."""
    from raymoe.models.common.row_attention import grouped_attention, visible_keys
    from raymoe.models.common.sdpa_choice import call_traits, choice_for_traits

    gen = torch.Generator().manual_seed(3)
    results = []
    for dtype in [torch.float32, torch.bfloat16] if device.type == "cuda" else [torch.float32]:
        for masked in (True, False):
            q = torch.randn(2, 8, 256, 64, generator=gen).to(device, dtype)
            k, v = (torch.randn(2, 2, 256, 64, generator=gen).to(device, dtype) for _ in range(2))
            allowed = visible_keys(256, 256, 0, 128, device) if masked else None
            row: dict[str, Any] = {"dtype": str(dtype).removeprefix("torch."), "masked": masked}
            if device.type == "cuda":
                row["traced_choice"] = choice_for_traits(device, call_traits(q, k, v, allowed, not masked), 0.125)
                row["eager_choice"] = int(
                    torch._fused_sdp_choice(q, k, v, allowed, 0.0, not masked, scale=0.125, enable_gqa=True)
                )
            torch._dynamo.reset()
            compiled = torch.compile(grouped_attention, backend="aot_eager", fullgraph=True)
            want = grouped_attention(q, k, v, 0.125, allowed, not masked).float()
            got = compiled(q, k, v, 0.125, allowed, not masked).float()
            row["max_error"] = float((got - want).abs().max() / want.abs().max())
            row["ok"] = row.get("traced_choice") == row.get("eager_choice") and row["max_error"] <= TOLERANCE[dtype]
            results.append(row)
            print(f"  compiled grouped attention {row}{'' if row['ok'] else '  FAILED'}")
    return results


def _check(
    device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, dim: int, value_dim: int, kind: str
) -> dict[str, float]:
    gen = torch.Generator().manual_seed(0)
    rows, chunk, scale = 2, 96, dim**-0.5
    q = torch.randn(rows, heads, chunk, dim, generator=gen, dtype=torch.float64)
    k = torch.randn(rows, kv_heads, chunk, dim, generator=gen, dtype=torch.float64)
    v = torch.randn(rows, kv_heads, chunk, value_dim, generator=gen, dtype=torch.float64)
    grad = torch.randn(rows, heads, chunk, value_dim, generator=gen, dtype=torch.float64)
    allowed = _allowed(kind, rows, chunk)
    block = Block(0, 0, 1, 0, causal=kind == "causal", windowed=kind == "masked")
    mask = None
    if kind == "masked":
        mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed.to(device), float("-inf"))

    # float64 reference on the CPU: out, lse and gradients
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    groups = heads // kv_heads
    kr, vr = leaves[1].repeat_interleave(groups, 1), leaves[2].repeat_interleave(groups, 1)
    scores = (leaves[0] @ kr.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.where(allowed, torch.exp(scores - lse[..., None]), 0.0)
    out = probs @ vr
    out.backward(grad)
    seen = allowed.any(-1).expand_as(lse)

    def on(x: Tensor) -> Tensor:
        return x.to(device=device, dtype=dtype)

    got_out, got_lse = _kernel_forward(on(q), on(k), on(v), mask, block, scale)
    # the ring's backward gets the merged log-sum-exp, finite where another block gave a row its keys
    merged = torch.where(seen, lse.detach(), 0.0).float().to(device)
    dq, dk, dv = _kernel_backward(on(grad), on(q), on(k), on(v), on(out.detach()), merged, mask, block, scale)

    def error(got: Tensor, want: Tensor, where: Tensor | None = None) -> float:
        got, want = got.detach().double().cpu(), want.detach()
        if where is not None:
            got, want = got[where], want[where]
        return float((got - want).abs().max() / want.abs().max().clamp_min(1e-12))

    return {
        "out": error(got_out, out, seen[..., None].expand_as(out) if kind == "masked" else None),
        "lse": error(got_lse, lse, seen if kind == "masked" else None),
        "dq": error(dq, leaves[0].grad),
        "dk": error(dk, leaves[1].grad),
        "dv": error(dv, leaves[2].grad),
    }


def _allowed(kind: str, rows: int, chunk: int) -> Tensor:
    """``[B | 1, 1, c, c]`` the keys each query sees in the block: a diagonal (causal), an earlier chunk of keys
    (whole), or an earlier chunk under a window of 40 and a document boundary in the keys' chunk (row 1 only), so
    later queries see no key of the block (masked)."""
    if kind == "whole":
        return torch.ones(1, 1, chunk, chunk, dtype=torch.bool)
    if kind == "causal":
        return torch.ones(chunk, chunk, dtype=torch.bool).tril()[None, None]
    distance = (chunk + torch.arange(chunk))[:, None] - torch.arange(chunk)[None, :]  # queries one chunk later
    window = (distance < 40)[None]
    key_document = (torch.arange(chunk) >= chunk - 10).long()  # the last 10 keys start the queries' document
    same = torch.stack([torch.ones(chunk, chunk, dtype=torch.bool), key_document[None, :].expand(chunk, chunk) == 1])
    return (window & same)[:, None]


def _time_block(device: torch.device, chunk: int = 8192) -> dict[str, float]:
    """Seconds of one causal 8k x 8k block, forward + backward, through the ring's kernel and through SDPA."""
    heads, dim = 16, 128
    q, k, v = (torch.randn(1, heads, chunk, dim, device=device, dtype=torch.bfloat16) for _ in range(3))
    grad = torch.randn_like(q)
    block = Block(0, 0, 0, 0, causal=True, windowed=False)

    def ring() -> None:
        out, lse = _kernel_forward(q, k, v, None, block, dim**-0.5)
        _kernel_backward(grad, q, k, v, out, lse, None, block, dim**-0.5)

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]

    def sdpa() -> None:
        F.scaled_dot_product_attention(*leaves, is_causal=True).backward(grad)

    return {"ring_kernel_s": _seconds(ring), "sdpa_s": _seconds(sdpa)}


def _seconds(fn: Any, iters: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    began = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - began) / iters
