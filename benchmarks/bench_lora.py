"""LoRA memory and speed (issue 30): full fine-tuning against LoRA, side by side in one run, per rank.

LoRA here is r 16, alpha 32 on the attention projections (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``) and on
every expert's ``gate_up_proj`` and ``down_proj`` (``target_parameters``); the base is frozen. Full fine-tuning
trains every parameter. Both with AdamW (torch's fused step, as the ranks run it), lr 1e-4, clipping at 1.0.
Methods: ``full``, ``lora`` and, for gpt-oss, ``lora-mxfp4`` (``quantized_experts="mxfp4"``: the frozen experts
kept packed on the ranks, dequantized inside each projection).

Measured, on CPU-sized slices of the real models (random weights written by transformers' ``save_pretrained``;
nothing is downloaded). Each slice keeps its model's layer shapes and routing and has fewer layers and experts and
a smaller vocabulary (``SLICES``; the run prints the shapes):

    qwen3-30b-a3b slice   hidden 2048, 32 heads / 4 kv heads of 128, experts of moe_intermediate 768, top-8;
                          2 layers (of 48), 16 experts (of 128), vocabulary 8192 (of 151936). Twice: an fp32 base
                          (fp32 checkpoint, precision fp32) and a bf16 base (``dtype=torch.bfloat16``:
                          bf16-mixed, so full fine-tuning holds fp32 masters and LoRA a bf16 frozen base)
    gpt-oss-120b slice    hidden 2880, 64 heads / 8 kv heads of 64, experts of intermediate 2880 (biases, the
                          clamped SwiGLU), top-4, attention biases and sinks; 1 layer (of 36), 8 experts (of 128),
                          vocabulary 8192 (of 201088). Its checkpoint holds the experts in MXFP4 as the hub does
                          (``*_blocks`` + ``*_scales``, quantized here): ``full`` and ``lora`` load them
                          dequantized (to bf16), ``lora-mxfp4`` keeps them packed

at world 1 (a ``LocalRankGroup``: one rank in this process, no Ray) and world 4 (``fsdp_size=4, ep_size=4`` on
four Ray rank actors), on the same global batch (``--rows`` x ``--seq``, split over the data-parallel ranks), one
torch thread per rank (``--threads`` for world 1's: on a shared 2-core machine, two threads wait at every op for a
core another process holds, and which method that hurts more changes from minute to minute). Per rank, read on
the rank after a warm-up step (the AdamW moments exist from there on), the largest rank's shown:

    parameters       local bytes of every parameter (trainable, and the frozen base)
    gradients        local bytes of every ``.grad`` when the optimizer step begins (a step pre-hook)
    AdamW states     ``exp_avg`` + ``exp_avg_sq`` (the per-tensor ``step`` counters, 4 bytes each, apart)
    step peak        the bytes held when a step begins (parameters, buffers, AdamW states) + the most that step
                     allocates beyond them (activations, gradients, all-gathered weights, temporaries): torch's
                     profiler's allocation records on CPU, ``torch.cuda.max_memory_allocated`` on a GPU. Tensor
                     bytes, not RSS: a rank process's ~300 MiB baseline (Python, torch, Ray) would hide the ratio
    unit gathers     world 1 under bf16 compute: what gathering each FSDP2 unit alone allocates (the fsdp_plan's
                     units: the embedding, each decoder layer, the final norm + head; a step gathers them one at a
                     time), the largest against :func:`gathered_unit_bytes` (a layer in the compute dtype, its
                     experts packed under ``lora-mxfp4``)

and checked: every rank's adapter AdamW moments are exactly 2 x 4 x its trainable parameters, no frozen parameter
holds a gradient (before or after the step) or optimizer state, the load report's trainable count is the rank's,
and parameters / gradients / AdamW states equal :func:`whole_model_bytes` on the slice's dimensions.
tokens/s: global tokens (``rows * (seq - 1)``) per second of a driver ``train_step``, median of ``--steps`` after the
warm-up, best of ``--rounds`` rounds in which full fine-tuning and LoRA alternate (the machine is shared: compare
the ratios of one run; the load average is recorded beside each layout).

Computed (arithmetic, not measured: :func:`whole_model_bytes`), for the whole Qwen3-30B-A3B and gpt-oss-120b on
8 x 80 GB (fsdp8/ep8) and 1 x 141 GB: parameters + gradients + AdamW states per rank, full fine-tuning
(bf16-mixed) against LoRA (bf16 frozen base, fp32 adapters; gpt-oss also with its experts packed), and what fits
where; activations excluded.

    .venv/bin/python benchmarks/bench_lora.py            # the committed table: ~10 min on 2 idle cores
    .venv/bin/python benchmarks/bench_lora.py --quick    # ~3 min smoke run: 1 round, fewer experts (not the table)
    .venv/bin/python benchmarks/bench_lora.py --report   # rewrite bench_lora.md from bench_lora.json

Writes ``--out``/bench_lora.json and bench_lora.md. Not run by the test suite.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import torch

R, ALPHA = 16, 32
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
FSDP4_EP4 = {"fsdp_size": 4, "ep_size": 4}
MXFP4_BYTES_PER_WEIGHT = 17 / 32  # a block of 32 fp4 values: 16 bytes + one uint8 (e8m0) scale = 4.25 bits
GB = 1e9
MIB = 2**20


# --- the models' dimensions and the arithmetic of their bytes -------------------------------------------------


@dataclass(frozen=True)
class ModelDims:
    """A Qwen3-MoE or gpt-oss model's dimensions: every parameter it has follows from these."""

    name: str
    family: str  # "qwen3_moe" | "gpt_oss"
    hidden: int
    layers: int
    experts: int
    top_k: int
    expert_intermediate: int  # Qwen3-MoE's moe_intermediate_size, gpt-oss's intermediate_size
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @property
    def gpt_oss(self) -> bool:
        return self.family == "gpt_oss"

    def expert_weights(self) -> int:
        """Routed-expert weights of the whole model, biases not counted: ``gate_up [2I, H]`` + ``down [H, I]`` each."""
        h, i = self.hidden, self.expert_intermediate
        return self.layers * self.experts * (2 * i * h + h * i)

    def expert_biases(self) -> int:
        """gpt-oss's expert biases (``[2I]`` + ``[H]`` per expert); Qwen3-MoE has none."""
        return self.layers * self.experts * (2 * self.expert_intermediate + self.hidden) if self.gpt_oss else 0

    def dense_params(self) -> int:
        """Every parameter but the routed experts: attention (with gpt-oss's biases and sinks, Qwen3's q/k norms),
        the router, the two norms of each layer, the embedding, the final norm and the untied head."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        attention = h * q + 2 * h * kv + q * h
        attention += (q + 2 * kv + h + self.heads) if self.gpt_oss else 2 * self.head_dim
        router = self.experts * h + (self.experts if self.gpt_oss else 0)
        return self.layers * (attention + router + 2 * h) + 2 * self.vocab * h + h

    def params(self) -> int:
        return self.dense_params() + self.expert_weights() + self.expert_biases()

    def adapter_params(self, r: int = R) -> tuple[int, int]:
        """LoRA factors ``r * (in + out)`` per adapted weight: (on the attention projections, on the experts)."""
        h, i, q, kv = self.hidden, self.expert_intermediate, self.heads * self.head_dim, self.kv_heads * self.head_dim
        attention = r * ((h + q) + 2 * (h + kv) + (q + h))
        experts = self.experts * r * ((h + 2 * i) + (i + h))
        return self.layers * attention, self.layers * experts

    def describe(self) -> str:
        inner = "moe_intermediate" if not self.gpt_oss else "intermediate"
        return (
            f"{self.name}: hidden {self.hidden}, {self.layers} layer{'s' if self.layers > 1 else ''}, "
            f"{self.experts} experts top-{self.top_k} "
            f"({inner} {self.expert_intermediate}), {self.heads} heads / {self.kv_heads} kv heads of "
            f"{self.head_dim}, vocabulary {self.vocab}; {self.params() / 1e9:.3f} B parameters"
            f"{', MXFP4 experts' if self.gpt_oss else ''}"
        )


def whole_model_bytes(
    dims: ModelDims, method: str, *, ranks: int = 1, base_bytes: int = 2, packed_experts: bool = False, r: int = R
) -> dict[str, float]:
    """Bytes of parameters, gradients and AdamW states per rank, computed from the model's dimensions (not measured).

    With ``P_d`` the dense parameters (everything but the routed experts), ``P_e`` the experts' (weights
    ``W_e`` and biases), ``A_d`` / ``A_e`` the LoRA factors on the attention projections / the experts
    (``r * (in + out)`` per adapted weight, one adapter per expert), a rank of fsdp ``n`` / ep ``n`` holds
    ``1 / n`` of each (FSDP2 shards every dense tensor ``n`` ways, EP gives each rank ``E / n`` experts, whose FSDP
    group is then 1), so with ``P = (P_d + P_e) / n`` and ``A = (A_d + A_e) / n``::

        full (fp32 masters: precision fp32 or bf16-mixed)   parameters 4 P   gradients 4 P   AdamW 2 * 4 P
        lora (frozen base of base_bytes, fp32 adapters)      parameters b P + 4 A   gradients 4 A   AdamW 2 * 4 A

    ``b`` = ``base_bytes`` (2: bf16, 4: fp32). ``packed_experts`` (LoRA only: ``quantized_experts="mxfp4"``) holds
    the expert weights ``W_e`` packed, 17 / 32 bytes each (a block of 32 fp4 values is 16 bytes + one uint8 scale),
    their biases in ``b``. Not counted: activations, FSDP2's all-gathered (bf16) copies of the units in flight
    (one decoder layer at a time, and the head's unit; :func:`gathered_unit_bytes`), AdamW's step counters (4
    bytes per tensor), allocator slack.
    """
    if method not in ("full", "lora"):
        raise ValueError(f"method {method!r}: 'full' or 'lora'")
    if packed_experts and method != "lora":
        raise ValueError("packed_experts: LoRA only (full fine-tuning trains fp32 masters of the experts)")
    total = dims.params()
    if method == "full":
        params = grads = 4.0 * total / ranks
        return {"parameters": params, "gradients": grads, "adamw": 2 * params, "total": 4 * params}
    adapters = sum(dims.adapter_params(r)) / ranks
    base = float(base_bytes * total)
    if packed_experts:
        base += (MXFP4_BYTES_PER_WEIGHT - base_bytes) * dims.expert_weights()
    params = base / ranks + 4 * adapters
    grads = 4 * adapters
    return {"parameters": params, "gradients": grads, "adamw": 2 * grads, "total": params + grads + 2 * grads}


# The real models' config.json numbers (Qwen/Qwen3-30B-A3B, openai/gpt-oss-120b; written from their hub configs, not
# downloaded here): main() checks their totals against the parameter counts of the model cards.
QWEN3_30B_A3B = ModelDims(
    "Qwen3-30B-A3B", "qwen3_moe", hidden=2048, layers=48, experts=128, top_k=8, expert_intermediate=768,
    heads=32, kv_heads=4, head_dim=128, vocab=151936,
)  # fmt: skip
GPT_OSS_120B = ModelDims(
    "gpt-oss-120b", "gpt_oss", hidden=2880, layers=36, experts=128, top_k=4, expert_intermediate=2880,
    heads=64, kv_heads=8, head_dim=64, vocab=201088,
)  # fmt: skip
PUBLISHED_PARAMS = {"Qwen3-30B-A3B": 30.5e9, "gpt-oss-120b": 116.8e9}  # model cards: 30.5 B, 116.83 B
HARDWARE = [("8 x 80 GB", 8, 80 * GB, "fsdp8/ep8"), ("1 x 141 GB", 1, 141 * GB, "one rank")]


@dataclass(frozen=True)
class Slice:
    """A CPU-sized slice of a real model: its dimensions here, and the base precisions it is run in."""

    key: str
    real: ModelDims
    dims: ModelDims
    bases: tuple[str, ...]  # "fp32" | "bf16"
    methods: tuple[str, ...] = ("full", "lora")

    def describe(self) -> str:
        return f"{self.dims.describe()} (a slice of {self.real.name})".replace(
            f"{self.dims.name}: ", f"{self.key}: ", 1
        )


SLICES = {
    "qwen3": Slice(
        "qwen3-30b-a3b slice", QWEN3_30B_A3B, replace(QWEN3_30B_A3B, name="slice", layers=2, experts=16, vocab=8192),
        bases=("fp32", "bf16"),
    ),
    "gpt-oss": Slice(
        "gpt-oss-120b slice", GPT_OSS_120B, replace(GPT_OSS_120B, name="slice", layers=1, experts=8, vocab=8192),
        bases=("bf16",), methods=("full", "lora", "lora-mxfp4"),
    ),
}  # fmt: skip
QUICK_EXPERTS = {"qwen3": 8, "gpt-oss": 4}


# --- checkpoints, written by transformers ---------------------------------------------------------------------


def save_slice(directory: Path, dims: ModelDims) -> Path:
    """A random checkpoint of ``dims`` saved by transformers (seed 0): Qwen3-MoE in fp32; gpt-oss in bf16 with its
    experts then packed in MXFP4 as the hub ships them (``*_blocks [E, out, in/32, 16]`` + ``*_scales``)."""
    import transformers

    if dims.gpt_oss:
        config = transformers.GptOssConfig(
            vocab_size=dims.vocab, hidden_size=dims.hidden, intermediate_size=dims.expert_intermediate,
            num_hidden_layers=dims.layers, num_attention_heads=dims.heads, num_key_value_heads=dims.kv_heads,
            head_dim=dims.head_dim, num_local_experts=dims.experts, num_experts_per_tok=dims.top_k,
        )  # fmt: skip
    else:
        config = transformers.Qwen3MoeConfig(
            vocab_size=dims.vocab, hidden_size=dims.hidden, intermediate_size=6144,
            moe_intermediate_size=dims.expert_intermediate, num_hidden_layers=dims.layers,
            num_attention_heads=dims.heads, num_key_value_heads=dims.kv_heads, head_dim=dims.head_dim,
            num_experts=dims.experts, num_experts_per_tok=dims.top_k, norm_topk_prob=True,
        )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        dtype = torch.bfloat16 if dims.gpt_oss else torch.float32
        transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).save_pretrained(directory)
    if dims.gpt_oss:
        pack_experts_mxfp4(directory)
    return directory


def pack_experts_mxfp4(directory: Path) -> None:
    """Replace gpt-oss's plain expert weights (transformers' ``[E, in, out]``) by MXFP4 blocks and scales."""
    from safetensors.torch import load_file, save_file

    path = directory / "model.safetensors"
    tensors = {}
    for key, tensor in load_file(path).items():
        if key.endswith(("experts.gate_up_proj", "experts.down_proj")):
            parts = [quantize_mxfp4(expert.transpose(0, 1)) for expert in tensor]  # [out, in], blocks along `in`
            tensors[f"{key}_blocks"] = torch.stack([blocks for blocks, _ in parts])
            tensors[f"{key}_scales"] = torch.stack([scales for _, scales in parts])
        else:
            tensors[key] = tensor
    save_file(tensors, path, metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                                   "lm_head"],
    }  # fmt: skip
    (directory / "config.json").write_text(json.dumps(config, indent=2))


def quantize_mxfp4(weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[R, C]`` -> blocks uint8 ``[R, C/32, 16]``, scales uint8 ``[R, C/32]``: per 32 values the smallest power of
    two ``2**e`` with ``max|x| <= 6 * 2**e`` (scale ``e + 127``), then each value's nearest e2m1 code (1 sign, 2
    exponent, 1 mantissa bit; magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6), two codes a byte, low nibble first."""
    rows, cols = weights.shape
    groups = weights.float().contiguous().reshape(rows, cols // 32, 32)
    amax = groups.abs().amax(-1, keepdim=True)
    exponent = torch.where(amax > 0, torch.ceil(torch.log2(amax / 6)), torch.zeros_like(amax)).clamp(-127, 127)
    scaled = groups / torch.exp2(exponent)
    midpoints = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    codes = (torch.bucketize(scaled.abs(), midpoints) | ((scaled < 0).long() << 3)).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exponent.squeeze(-1) + 127).to(torch.uint8)


def packed_bytes_in_file(directory: Path) -> int:
    """Bytes of the experts' ``*_blocks`` and ``*_scales`` tensors in the checkpoint file."""
    from safetensors import safe_open

    with safe_open(str(directory / "model.safetensors"), framework="pt") as file:
        keys = [key for key in file.keys() if key.endswith(("_blocks", "_scales"))]  # noqa: SIM118 (no __iter__)
        return sum(math.prod(file.get_slice(key).get_shape()) for key in keys)  # uint8: a byte each


# --- on the ranks -----------------------------------------------------------------------------------------------


def rank_memory(ctx: Any, rows: int, seq: int, vocab: int) -> dict[str, Any]:
    """This rank's bytes of parameters, gradients and AdamW states, and one training step's peak (see the module
    docstring), with the checks: frozen parameters without gradients or optimizer state. Call after a step."""
    import torch
    from torch.distributed.tensor import DTensor

    from raymoe.rank.contract import MicroBatch
    from raymoe.rank.train import train_step

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if isinstance(t, DTensor) else t

    def nbytes(t: torch.Tensor) -> int:
        t = local(t)
        return t.numel() * t.element_size()

    loaded = ctx.require_model()
    optimizer = loaded.require_training().optimizer
    named = loaded.named_parameters()
    trainable = [p for _, p in named if p.requires_grad]
    frozen = [(name, p) for name, p in named if not p.requires_grad]
    optimized = {id(p) for group in optimizer.param_groups for p in group["params"]}
    moments = counters = 0
    for state in optimizer.state.values():
        moments += nbytes(state["exp_avg"]) + nbytes(state["exp_avg_sq"])
        counters += nbytes(state["step"]) if isinstance(state.get("step"), torch.Tensor) else 0
    seen: dict[str, Any] = {}

    def before_step(*_: Any) -> None:
        seen["gradients"] = sum(nbytes(p.grad) for _, p in named if p.grad is not None)
        seen["gradient_dtypes"] = sorted({str(p.grad.dtype) for _, p in named if p.grad is not None})
        seen["base_gradients"] = [name for name, p in frozen if p.grad is not None]

    gen = torch.Generator().manual_seed(1000 + ctx.rank)
    ids = torch.randint(0, vocab, (rows, seq), generator=gen)
    pieces = [MicroBatch(ids, ids.clone(), torch.ones_like(ids, dtype=torch.bool))]
    held = _held_bytes(loaded, local)
    hook = optimizer.register_step_pre_hook(before_step)
    try:
        beyond = _allocated_beyond(lambda: train_step(ctx, pieces, ids.numel() * ctx.topology.world_size), ctx.device)
    finally:
        hook.remove()
    gathers = _unit_gather_bytes(loaded, ctx.device) if ctx.topology.world_size == 1 else {}
    by_dtype: dict[str, int] = {}
    for p in trainable:
        by_dtype[f"trainable {p.dtype}"] = by_dtype.get(f"trainable {p.dtype}", 0) + nbytes(p)
    for _, p in frozen:
        by_dtype[f"frozen {p.dtype}"] = by_dtype.get(f"frozen {p.dtype}", 0) + nbytes(p)
    return {
        "rank": ctx.rank,
        "trainable_params": sum(local(p).numel() for p in trainable),
        "frozen_params": sum(local(p).numel() for _, p in frozen),
        "trainable_bytes": sum(nbytes(p) for p in trainable),
        "frozen_bytes": sum(nbytes(p) for _, p in frozen),
        "parameter_bytes_by_dtype": by_dtype,
        "gradient_bytes": seen["gradients"],
        "gradient_dtypes": seen["gradient_dtypes"],
        "adamw_moment_bytes": moments,
        "adamw_step_counter_bytes": counters,
        "held_bytes": held,
        "step_growth_bytes": beyond,
        "step_peak_bytes": held + beyond,
        "unit_gather_bytes": gathers,
        "base_gradients_before_step": seen["base_gradients"],
        "base_gradients_after_step": [name for name, p in frozen if p.grad is not None],
        "frozen_in_optimizer": sum(id(p) in optimized or p in optimizer.state for _, p in frozen),
        "optimized_not_trainable": len(optimized - {id(p) for p in trainable}),
    }


def _unit_gather_bytes(loaded: Any, device: torch.device) -> dict[str, int]:
    """What gathering each FSDP2 unit alone allocates, by module path ({}: no FSDP2). The fsdp_plan's units apply
    on one rank too, so a step gathers one decoder layer (or the embedding, or the final norm + head) at a time."""
    from torch.distributed.fsdp import FSDPModule

    units: dict[int, list[tuple[str, Any]]] = {}  # modules wrapped together (the final norm + head) share a group
    for part in loaded.parts:
        for name, module in part.named_modules():
            if isinstance(module, FSDPModule):
                group = module._get_fsdp_state()._fsdp_param_group
                units.setdefault(id(group) if group is not None else id(module), []).append((name or "(root)", module))
    out = {}
    for members in units.values():
        module = members[0][1]
        out["+".join(name for name, _ in members)] = _allocated_beyond(module.unshard, device)
        module.reshard()
    return out


def release_memory(ctx: Any) -> None:
    """Give the allocator's free pages back to the system after a model is unloaded (glibc keeps them otherwise,
    and a rank or the driver would carry each model's high-water mark into the next)."""
    import ctypes
    import gc

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def _held_bytes(loaded: Any, local: Callable[[torch.Tensor], torch.Tensor]) -> int:
    """Bytes of the storages the rank holds between steps: parameters, buffers, AdamW states (each storage once)."""
    tensors = [t for part in loaded.parts for t in part.state_dict(keep_vars=True).values()]
    if loaded.training is not None:
        tensors += [v for state in loaded.training.optimizer.state.values() for v in state.values()]
    storages = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            storage = local(t).untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _allocated_beyond(fn: Callable[[], Any], device: torch.device) -> int:
    """The most tensor bytes ``fn()`` holds at once beyond what was live at its start. GPU: the allocator's peak.
    CPU: the running sum, in time order, of torch's profiler's allocation records (``profile_memory``; the raw
    records, not its memory timeline, as ``tests/rank/test_state_memory.py`` reads them)."""
    import numpy as np
    from torch._C._profiler import _EventType

    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return int(torch.cuda.max_memory_allocated() - start)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    pending, records = list(prof.profiler.kineto_results.experimental_event_tree()), []
    while pending:
        event = pending.pop()
        pending.extend(event.children)
        if event.tag == _EventType.Allocation and event.extra_fields.device.type == "cpu":
            records.append((event.start_time_ns, event.extra_fields.alloc_size))
    held = np.cumsum([size for _, size in sorted(records)])
    return max(int(held.max()), 0) if len(held) else 0


# --- on the driver ----------------------------------------------------------------------------------------------


@dataclass
class Row:
    """One (slice, base, world, method): the largest rank's figures, every rank's checks, the best tokens/s."""

    slice: str
    base: str
    world: int
    method: str
    ranks: list[dict[str, Any]] = field(default_factory=list)
    report_trainable_params: list[int] = field(default_factory=list)  # LoadReport, per rank
    describe: str = ""
    tokens_per_s: float = 0.0
    rounds: list[float] = field(default_factory=list)
    load_average: list[float] = field(default_factory=list)  # the 1-minute load average at each round's end
    computed: dict[str, float] = field(default_factory=dict)  # whole_model_bytes on the slice, per rank

    def largest(self, key: str) -> int:
        return max(int(rank[key]) for rank in self.ranks)

    @property
    def layout(self) -> str:
        return "one rank (no Ray)" if self.world == 1 else "fsdp4/ep4 on Ray"

    def checks(self) -> dict[str, bool]:
        """Every rank: adapter moments = 2 x 4 x trainable; no base gradient or base optimizer state; the load
        report's trainable count; parameters / gradients / AdamW = the computed bytes."""
        out = {
            "adamw = 2 x 4 x trainable": all(r["adamw_moment_bytes"] == 8 * r["trainable_params"] for r in self.ranks),
            "no base gradient": all(
                not r["base_gradients_before_step"] and not r["base_gradients_after_step"] for r in self.ranks
            ),
            "no base optimizer state": all(
                r["frozen_in_optimizer"] == 0 and r["optimized_not_trainable"] == 0 for r in self.ranks
            ),
            "load report = trainable": [r["trainable_params"] for r in self.ranks] == self.report_trainable_params,
            "= computed": all(
                r["trainable_bytes"] + r["frozen_bytes"] == self.computed["parameters"]
                and r["gradient_bytes"] == self.computed["gradients"]
                and r["adamw_moment_bytes"] == self.computed["adamw"]
                for r in self.ranks
            ),
        }
        if self.method == "full":
            out["no base gradient"] = out["no base optimizer state"] = True  # nothing is frozen
        return out


def lora_config() -> Any:
    import raymoe

    return raymoe.LoraConfig(r=R, lora_alpha=ALPHA, target_modules=ATTENTION, target_parameters=EXPERTS)


def load(directory: Path, world: Any, layout: dict[str, int], base: str, method: str) -> Any:
    import raymoe

    return raymoe.from_pretrained(
        directory,
        distributed_config=layout,
        world=world,
        dtype=torch.bfloat16 if base == "bf16" else None,
        lora=lora_config() if method.startswith("lora") else None,
        quantized_experts="mxfp4" if method == "lora-mxfp4" else None,
    )


def measure_layout(
    directory: Path, s: Slice, base: str, world: Any, world_size: int, args: argparse.Namespace
) -> list[Row]:
    """Full fine-tuning and LoRA on one layout, alternating for ``--rounds`` rounds; memory in the first round."""
    layout, dims = FSDP4_EP4 if world_size == 4 else {}, s.dims
    rows = {method: Row(s.key, base, world_size, method) for method in s.methods}
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, dims.vocab, (args.rows, args.seq), generator=gen) for _ in range(1 + args.steps)]
    base_bytes = 2 if base == "bf16" else 4
    for index in range(args.rounds):
        for method, row in rows.items():
            began = time.perf_counter()
            with load(directory, world, layout, base, method) as model:
                loaded_s = time.perf_counter() - began
                model.configure_training(lr=1e-4)
                model.train_step(batches[0])  # creates the AdamW moments
                if index == 0:
                    row.ranks = model.run_on_ranks(rank_memory, args.rows // world_size, args.seq, dims.vocab)
                    row.report_trainable_params = [report.trainable_params for report in model.load_reports]
                    row.describe = model.describe()
                    row.computed = whole_model_bytes(
                        dims,
                        method.partition("-")[0],
                        ranks=world_size,
                        base_bytes=base_bytes,
                        packed_experts=method == "lora-mxfp4",
                    )
                times = []
                for ids in batches[1:]:
                    start = time.perf_counter()
                    model.train_step(ids)
                    times.append(time.perf_counter() - start)
            world.execute(release_memory)
            speed = args.rows * (args.seq - 1) / statistics.median(times)
            row.rounds.append(speed)
            row.load_average.append(os.getloadavg()[0])
            row.tokens_per_s = max(row.rounds)
            print(
                f"  {row.slice} {base} world {world_size} {method:4s} round {index + 1}: {speed:7.0f} tokens/s "
                f"(steps {', '.join(f'{t:.2f}' for t in times)} s; load {loaded_s:.1f} s; load average "
                f"{row.load_average[-1]:.1f})",
                flush=True,
            )
    for row in rows.values():
        if row.method != "full":
            print("    " + row.describe.splitlines()[-1], flush=True)
        print(f"    {row.method}: checks {row.checks()}", flush=True)
    return list(rows.values())


def run(args: argparse.Namespace) -> tuple[list[Row], dict[str, Any], dict[str, Slice]]:
    from raymoe.rank.local import LocalRankGroup

    slices = {key: SLICES[key] for key in args.slices}
    if args.quick:
        slices = {
            key: replace(s, dims=replace(s.dims, experts=QUICK_EXPERTS[key]), bases=s.bases[:1])
            for key, s in slices.items()
        }
    rows: list[Row] = []
    packed: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        directories = {}
        for key, s in slices.items():
            began = time.perf_counter()
            directories[key] = save_slice(Path(tmp) / key, s.dims)
            print(f"{s.describe()}; checkpoint written in {time.perf_counter() - began:.0f} s", flush=True)
            if s.dims.gpt_oss:
                packed[s.key] = {
                    "computed": MXFP4_BYTES_PER_WEIGHT * s.dims.expert_weights(),
                    "in_checkpoint": packed_bytes_in_file(directories[key]),
                    "dequantized_bf16": 2 * s.dims.expert_weights(),
                }
        for world_size in args.worlds:
            if world_size == 1:
                torch.set_num_threads(args.threads)
                world: Any = LocalRankGroup()
            else:
                import ray

                import raymoe

                release_memory(None)  # what the world-1 models left in this process
                ray.init(address="local", num_cpus=world_size, include_dashboard=False, log_to_driver=False)
                world = raymoe.start_world(world_size)
            try:
                for key, s in slices.items():
                    for base in s.bases:
                        print(f"{s.key}, {base} base, world {world_size}", flush=True)
                        rows += measure_layout(directories[key], s, base, world, world_size, args)
                        write(rows, packed, slices, args)
            finally:
                world.shutdown()
    return rows, packed, slices


# --- the report -------------------------------------------------------------------------------------------------


def whole_model_rows() -> list[dict[str, Any]]:
    """The computed whole-model table: each model, method and hardware."""
    out = []
    for dims in (QWEN3_30B_A3B, GPT_OSS_120B):
        lora = "LoRA r16 (bf16 base, dequantized experts)" if dims.gpt_oss else "LoRA r16 (bf16 base)"
        variants = [("full FT (bf16-mixed)", "full", False), (lora, "lora", False)]
        if dims.gpt_oss:
            variants.append(("LoRA r16, MXFP4 experts packed (quantized_experts)", "lora", True))
        for label, method, packed in variants:
            for hardware, ranks, capacity, layout in HARDWARE:
                got = whole_model_bytes(dims, method, ranks=ranks, packed_experts=packed)
                units = gathered_unit_bytes(dims, method, packed, ranks=ranks)
                out.append(
                    {"model": dims.name, "method": label, "hardware": hardware, "layout": layout,
                     **{k: v / GB for k, v in got.items()}, "left_gb": (capacity - got["total"]) / GB,
                     "fits": got["total"] <= capacity, "layer_gather_gb": units["layer"] / GB,
                     "head_gather_gb": units["head"] / GB, "in_flight_gb": units["in_flight"] / GB,
                     "left_with_gathers_gb": (capacity - got["total"] - units["in_flight"]) / GB}
                )  # fmt: skip
    return out


def gathered_unit_bytes(
    dims: ModelDims, method: str = "lora", packed_experts: bool = False, *, ranks: int = 1, r: int = R
) -> dict[str, float]:
    """What a step's FSDP2 gathers allocate per rank under bf16 compute, computed (the fsdp_plan's units, also on one
    rank): ``layer``, one decoder layer in bf16 (attention, router, norms; its experts, of which a rank of ep
    ``ranks`` holds ``E / ranks`` and gathers nothing more, packed at 17 / 32 bytes a weight under
    ``packed_experts``; LoRA: its adapters cast to bf16); ``head``, the final norm + head (kept gathered from forward
    to backward); ``in_flight``: head + two layers (the one computing and the one FSDP2 prefetches in backward), an
    upper estimate of what is gathered at once. The same for full fine-tuning (bf16 copies of the fp32 masters).
    Measured beside it on the slices (the world-1 rows, each unit alone)."""
    h, i, experts = dims.hidden, dims.expert_intermediate, dims.experts / ranks
    dense = (dims.dense_params() - 2 * dims.vocab * h - h) / dims.layers  # attention, router, the layer's norms
    weights = experts * 3 * i * h
    biases = experts * (2 * i + h) if dims.gpt_oss else 0
    layer = 2.0 * (dense + biases) + (MXFP4_BYTES_PER_WEIGHT if packed_experts else 2.0) * weights
    if method == "lora":
        attention, on_experts = dims.adapter_params(r)
        layer += 2.0 * (attention + on_experts / ranks) / dims.layers
    head = 2.0 * (dims.vocab * h + h)
    return {"layer": layer, "head": head, "in_flight": head + 2 * layer}


def targets(rows: list[Row]) -> list[tuple[str, str, bool]]:
    """The issue's targets, each as (what, measured, met)."""
    by = {(r.slice, r.base, r.world, r.method): r for r in rows}
    out = []
    for (name, base, world, method), row in by.items():
        full = by.get((name, base, world, "full"))
        if method == "full" or full is None:
            continue
        where = f"{name}, {base} base, world {world}" + (f", {method}" if method != "lora" else "")
        if name.startswith("qwen3"):
            bound = 0.3 if base == "fp32" else 0.2
            ratio = row.largest("step_peak_bytes") / full.largest("step_peak_bytes")
            out.append((f"step peak <= {bound}x full FT: {where}", f"{ratio:.3f}x", ratio <= bound))
        speed = row.tokens_per_s / full.tokens_per_s
        out.append((f"tokens/s >= 1.0x full FT: {where}", f"{speed:.2f}x", speed >= 1.0))
        exact = row.checks()["adamw = 2 x 4 x trainable"]
        moments = row.largest("adamw_moment_bytes")
        out.append((f"adapter AdamW = 2 x 4 x trainable exactly: {where}", f"{moments:,} bytes", exact))
    return out


def mib(value: float) -> str:
    return f"{value / MIB:,.1f}"


def markdown(rows: list[Row], packed: dict[str, Any], slices: dict[str, Slice], args: argparse.Namespace) -> str:
    by = {(r.slice, r.base, r.world, r.method): r for r in rows}
    loads = [load for r in rows for load in r.load_average] or [0.0]
    lines = [
        f"LoRA r {R} (alpha {ALPHA}) on {', '.join(ATTENTION)} and {', '.join(EXPERTS)}; global batch "
        f"{args.rows}x{args.seq}; {args.steps} timed steps after 1 warm-up, best of {args.rounds} alternating rounds; "
        f"one torch thread per rank (world 1: {args.threads}); torch {torch.__version__}, {os.cpu_count()} CPUs, "
        f"shared: 1-minute load average {min(loads):.1f}-{max(loads):.1f} at the rounds' ends"
        f"{', ' + torch.cuda.get_device_name() if torch.cuda.is_available() else ''}",
        "",
        *[f"- {s.describe()}" for s in slices.values()],
        "",
        "| slice | base | world | method | trainable params | parameters MiB | gradients MiB | AdamW MiB "
        "| held MiB | step growth MiB | step peak MiB | peak vs full | tokens/s | vs full | checks |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        full = by.get((r.slice, r.base, r.world, "full"))
        params = max(rank["trainable_bytes"] + rank["frozen_bytes"] for rank in r.ranks)
        vs_peak = f"{r.largest('step_peak_bytes') / full.largest('step_peak_bytes'):.3f}x" if full else ""
        vs_speed = f"{r.tokens_per_s / full.tokens_per_s:.2f}x" if full else ""
        failed = [name for name, ok in r.checks().items() if not ok]
        lines.append(
            f"| {r.slice} | {r.base} | {r.world} | {r.method} | {r.largest('trainable_params'):,} | {mib(params)} "
            f"| {mib(r.largest('gradient_bytes'))} | {mib(r.largest('adamw_moment_bytes'))} "
            f"| {mib(r.largest('held_bytes'))} | {mib(r.largest('step_growth_bytes'))} "
            f"| {mib(r.largest('step_peak_bytes'))} | {vs_peak} "
            f"| {r.tokens_per_s:.0f} | {vs_speed} | {'all pass' if not failed else 'FAIL: ' + ', '.join(failed)} |"
        )
    lines += [
        "",
        "Per rank, the largest rank's (world 4: fsdp_size=4, ep_size=4). parameters: local bytes of every parameter "
        "(LoRA: the frozen base + the fp32 adapters); gradients: every .grad when the optimizer step begins; AdamW: "
        "exp_avg + exp_avg_sq (step counters apart); held: the bytes held when a step begins (parameters, buffers, "
        "AdamW states); step growth: the most the step allocates beyond them (activations, gradients, all-gathered "
        "weights, temporaries); step peak = held + step growth; tensor "
        "bytes from torch's profiler, not RSS. checks: every rank's AdamW moments = 2 x 4 x its trainable parameters, "
        "no frozen parameter with a gradient (before or after the step) or optimizer state, the load report's "
        "trainable count, and parameters / gradients / AdamW = whole_model_bytes on the slice's dimensions.",
        "",
    ]
    for name, figures in packed.items():
        measured = [r for r in rows if r.slice == name and r.method == "lora-mxfp4" and r.world == 1]
        uint8 = [rank["parameter_bytes_by_dtype"].get("frozen torch.uint8", 0) for r in measured for rank in r.ranks]
        held = max(uint8, default=0)
        lines.append(
            f"{name}: expert weights at world 1: {mib(figures['dequantized_bf16'])} MiB dequantized (bf16: full, "
            f"lora); packed MXFP4, computed (4.25 bits a weight: 16 bytes of fp4 values + 1 uint8 scale per 32): "
            f"{mib(figures['computed'])} MiB; the checkpoint's *_blocks + *_scales: {mib(figures['in_checkpoint'])} "
            f"MiB; measured under lora-mxfp4 (the rank's uint8 parameters): {mib(held)} MiB."
        )
    for r in rows:
        units = {name: size for rank in r.ranks for name, size in (rank.get("unit_gather_bytes") or {}).items()}
        if r.world == 1 and units:
            dims = next(s.dims for s in slices.values() if s.key == r.slice)
            computed = gathered_unit_bytes(dims, r.method.partition("-")[0], r.method == "lora-mxfp4")
            layers = [size for name, size in units.items() if name.startswith("model.layers.")]
            listed = ", ".join(f"{name} {mib(size)}" for name, size in units.items() if size)
            cast = " (+ the bf16 cast of the fp32 masters in flight)" if r.method == "full" else ""
            lines.append(
                f"Unit gathers, {r.slice} {r.base} {r.method}: each FSDP2 unit gathered alone allocates (MiB) "
                f"{listed}; the largest, a decoder layer: {mib(max(layers, default=0))} MiB (measured; "
                f"gathered_unit_bytes: {mib(computed['layer'])} MiB a layer{cast}, {mib(computed['head'])} MiB "
                "the final norm + head, one unit: either module's unshard gathers both)."
            )
    lines += ["", "Targets (issue 30):", ""]
    lines += [f"- {what}: {got} — {'met' if ok else 'NOT met'}" for what, got, ok in targets(rows)]
    lines += ["", *whole_model_markdown()]
    return "\n".join(lines) + "\n"


def whole_model_markdown() -> list[str]:
    lines = ["Whole models, computed (whole_model_bytes: arithmetic from the config, not measured):", ""]
    for dims in (QWEN3_30B_A3B, GPT_OSS_120B):
        dense, experts = dims.adapter_params()
        lines.append(
            f"- {dims.describe()} (published {PUBLISHED_PARAMS[dims.name] / 1e9:.1f} B); LoRA r {R}: "
            f"{(dense + experts) / 1e9:.3f} B adapter parameters ({dense / 1e6:.1f} M on attention, "
            f"{experts / 1e6:.1f} M on experts)"
        )
    lines += [
        "",
        "| model | method | hardware | parameters GB | gradients GB | AdamW GB | total GB per rank "
        "| a layer gathered GB | fits? |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in whole_model_rows():
        fits = f"yes, {row['left_gb']:.0f} GB left" if row["fits"] else f"no, {-row['left_gb']:.0f} GB over"
        if row["fits"]:
            left = row["left_with_gathers_gb"]
            fits += f"; {left:.0f} GB after the gathers" if left > 0 else f"; {-left:.0f} GB over with the gathers"
        lines.append(
            f"| {row['model']} | {row['method']} | {row['hardware']} ({row['layout']}) | {row['parameters']:.1f} "
            f"| {row['gradients']:.1f} | {row['adamw']:.1f} | {row['total']:.1f} | {row['layer_gather_gb']:.2f} "
            f"| {fits} |"
        )
    lines += [
        "",
        "GB = 1e9 bytes; capacities taken as 80e9 and 141e9 bytes. Full FT: fp32 masters, gradients and both "
        "moments (16 bytes a parameter); LoRA: bf16 base (2 bytes), adapters with their gradients and moments in fp32 "
        "(16 bytes an adapter parameter). FSDP2 gathers one unit at a time (the fsdp_plan's units, on one rank too): "
        "a layer gathered is one decoder layer in bf16 per rank (its local experts only under EP; packed under "
        "quantized_experts), gathered_unit_bytes; 'after the gathers' also takes off the final norm + head (kept "
        "gathered through a step) and two layers (one computing, one prefetched), an upper estimate. Activations and "
        "allocator slack are excluded: what is left must hold them.",
    ]
    return lines


def write(rows: list[Row], packed: dict[str, Any], slices: dict[str, Slice], args: argparse.Namespace) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {
        "args": vars(args),
        "torch": torch.__version__,
        "slices": {key: {"key": s.key, "dims": asdict(s.dims), "bases": s.bases} for key, s in slices.items()},
        "rows": [{**asdict(r), "checks": r.checks(), "layout": r.layout} for r in rows],
        "mxfp4_expert_bytes": packed,
        "targets": [{"target": what, "measured": got, "met": ok} for what, got, ok in targets(rows)],
        "whole_models_computed": whole_model_rows(),
    }
    (out / "bench_lora.json").write_text(json.dumps(report, indent=1))
    (out / "bench_lora.md").write_text(markdown(rows, packed, slices, args))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--slices", nargs="+", default=list(SLICES), choices=list(SLICES))
    parser.add_argument("--worlds", nargs="+", type=int, default=[1, 4], choices=[1, 4])
    parser.add_argument("--rows", type=int, default=4, help="global batch rows (divisible by 4)")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per round, after one warm-up")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the world-1 rank (this process)")
    parser.add_argument("--quick", action="store_true", help="1 round, 2 steps, fewer experts, one base per slice")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--report", action="store_true", help="rewrite --out's report from its bench_lora.json")
    args = parser.parse_args()
    if args.report:
        saved = json.loads((Path(args.out) / "bench_lora.json").read_text())
        names = {f.name for f in fields(Row)}
        rows = [Row(**{k: v for k, v in row.items() if k in names}) for row in saved["rows"]]
        args = argparse.Namespace(**{**saved["args"], "out": args.out})
        slices = {key: SLICES[key] for key in args.slices}
        if args.quick:
            slices = {key: replace(s, dims=replace(s.dims, experts=QUICK_EXPERTS[key])) for key, s in slices.items()}
        write(rows, saved["mxfp4_expert_bytes"], slices, args)
        return
    if args.quick:
        args.rounds, args.steps = 1, 2
    for dims in (QWEN3_30B_A3B, GPT_OSS_120B):
        assert abs(dims.params() / PUBLISHED_PARAMS[dims.name] - 1) < 0.01, dims.describe()
    rows, packed, slices = run(args)
    print(markdown(rows, packed, slices, args))


if __name__ == "__main__":
    main()
