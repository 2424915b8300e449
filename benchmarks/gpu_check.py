"""The GPU check of issues 18, 36 and 33: raymoe's Qwen3-MoE block and one-rank training on one GPU, against
transformers, and the readiness paths of issue 36 (benchmarks/gpu_readiness.py).

Three parts, the first two in bf16 at the shape of Qwen/Qwen3-30B-A3B (hidden 2048, 128 experts, top-8, expert
intermediate 768):

    block   raymoe's SparseMoeBlock (router + GroupedExperts on torch._grouped_mm), forward + backward on
            --block-tokens tokens; TFLOP/s from counted FLOPs and the percentage of the GPU's dense bf16
            peak (a table by device name, or --peak-tflops). transformers' Qwen3MoeSparseMoeBlock with
            the same weights (experts_implementation "grouped_mm") is timed beside it where it builds, and
            raymoe's block under torch.compile ("raymoe compiled"; --no-compile leaves it out).
    train   a random 2-layer slice of Qwen3-30B-A3B written with save_pretrained, trained for a few
            AdamW steps (a) by transformers in this process (from_pretrained, grouped_mm experts) and
            (b) by raymoe.from_pretrained(world_size=1) on a local Ray: one rank actor holding the GPU,
            process group backend chosen by the rank (NCCL where it sees a GPU). Tokens/s (label tokens of
            a step over the median step time after warm-up) and peak GPU memory (max_memory_allocated: in
            this process for transformers, read on the rank for raymoe). The systems alternate for
            --rounds rounds, each keeping its best round. Then (c) raymoe with compile=True (compiled decoder
            blocks, issue 33) replaces (b) on the GPU and alternates with transformers the same way; its
            compile seconds are the warm-up's. --profile-steps N: after each pair's rounds, N more steps of
            each system under torch's profiler (CUDA kernel time, top operators; raymoe's on its rank).

    readiness   one rank in this process on tiny bf16 checkpoints: the default precision policy, 4 micro-batches
            against 1 (peak memory), fsdp_cpu_offload with bias balancing, async save_state / load_state
            (peak of the load against the state's bytes) and generate, with host syncs counted by raymoe's
            meter and by torch.cuda.set_sync_debug_mode("warn") (benchmarks/gpu_readiness.py)
    context     ring attention's block kernels (context parallelism, issue 32) on the device against float64
            attention: output, log-sum-exp and gradients of causal, whole and masked blocks, grouped kv heads,
            MLA's narrower value heads, float32 and bf16; one 8k causal block timed beside SDPA; the kernel choice
            for grouped kv heads a compiled block makes at trace time against eager's (issue 33)
            (benchmarks/gpu_context.py)

FLOPs of the block per token: routed experts 3 matmuls (gate, up, down) of 2*H*I per (token, expert)
pair, the router 2*H*E; the backward counts twice the forward (input and weight gradients).

Run it on a GPU machine (under 5 minutes at the defaults), or on CPU with tiny shapes to exercise the code:

    bash benchmarks/gpu_check.sh [--parts block train] [--out gpu_check.json]
    .venv/bin/python benchmarks/gpu_check.py --smoke          # CPU fp32 (figures not meaningful)

The table goes to stdout, every figure to a JSON file (--out; default $OUT/gpu_check.json when OUT is set,
else ./gpu_check.json). Not run by the test suite.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from gpu_context import run_context
from gpu_readiness import run_readiness
from torch import Tensor, nn

# Dense (no sparsity) bf16 tensor-core peaks from the vendors' datasheets, in TFLOP/s; the first name
# contained in torch.cuda.get_device_name() wins, so the specific variants come first.
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H200 NVL", 835.0),
    ("H100", 989.0),
    ("H200", 989.0),
    ("A100", 312.0),
)
SEED = 0
INIT_STD = 0.02


@dataclass(frozen=True)
class Shape:
    """The model slice (Qwen3-MoE config fields), the block's token count and the training batch."""

    vocab: int
    hidden: int
    intermediate: int
    moe_intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int
    top_k: int
    block_tokens: int
    batch: int
    seq: int


# Qwen/Qwen3-30B-A3B's config.json, cut to 2 layers.
FULL = Shape(
    vocab=151936,
    hidden=2048,
    intermediate=6144,
    moe_intermediate=768,
    layers=2,
    heads=32,
    kv_heads=4,
    head_dim=128,
    experts=128,
    top_k=8,
    block_tokens=8192,
    batch=4,
    seq=2048,
)
SMOKE = Shape(
    vocab=512,
    hidden=64,
    intermediate=128,
    moe_intermediate=32,
    layers=2,
    heads=4,
    kv_heads=2,
    head_dim=16,
    experts=8,
    top_k=2,
    block_tokens=256,
    batch=2,
    seq=32,
)


@dataclass(frozen=True)
class Settings:
    """Where and how long to run: device, dtype, iteration counts."""

    device: torch.device
    dtype: torch.dtype
    smoke: bool
    block_warmup: int
    block_iters: int
    train_warmup: int
    train_steps: int
    rounds: int
    telemetry: bool
    compile: bool = True  # also the compiled rows (issue 33)
    pure: bool = True  # also a raymoe row in bf16-pure, transformers' own precision
    profile_steps: int = 0  # after the timed rounds, this many steps of each system under torch's profiler


# --- timing ---------------------------------------------------------------------------------------


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds ``fn`` takes: CUDA events on a GPU (queued work drained first), wall clock on CPU."""
    if device.type != "cuda":
        began = time.perf_counter()
        fn()
        return time.perf_counter() - began
    synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1000.0


def peak_tflops(device: torch.device, override: float | None) -> tuple[float | None, str]:
    """The dense bf16 peak to compare against, and where it comes from."""
    if override is not None:
        return override, "--peak-tflops"
    if device.type != "cuda":
        return None, "no GPU: percentage of peak omitted"
    name = torch.cuda.get_device_name(device)
    for key, tflops in PEAK_BF16_TFLOPS:
        if key in name:
            return tflops, f"datasheet dense bf16 peak of {key}"
    return None, f"unknown device {name!r}: percentage of peak omitted (pass --peak-tflops)"


# --- part A: the MoE block ------------------------------------------------------------------------


def block_flops(shape: Shape, tokens: int) -> float:
    """FLOPs of one forward + backward of the block on ``tokens`` tokens (backward = 2x forward)."""
    experts = tokens * shape.top_k * 3 * 2 * shape.hidden * shape.moe_intermediate
    router = 2 * tokens * shape.hidden * shape.experts
    return 3.0 * (experts + router)


def build_raymoe_block(shape: Shape, settings: Settings) -> nn.Module:
    """raymoe's Qwen3-MoE ``SparseMoeBlock`` (router ``gate [E, H]``, experts ``[E, 2I, H]`` / ``[E, H, I]``),
    normal(0, 0.02) weights, in ``settings.dtype`` on ``settings.device``."""
    from raymoe.models.common.config import MoeConfig
    from raymoe.models.moe import SparseMoeBlock

    moe = MoeConfig(
        num_experts=shape.experts,
        num_experts_per_tok=shape.top_k,
        moe_intermediate_size=shape.moe_intermediate,
        norm_topk_prob=True,
    )
    torch.manual_seed(SEED)
    block = SparseMoeBlock(shape.hidden, moe)
    for parameter in block.parameters():
        nn.init.normal_(parameter, std=INIT_STD)
    return block.to(settings.device, settings.dtype).train()


def build_transformers_block(raymoe_block: nn.Module, shape: Shape) -> tuple[nn.Module | None, str]:
    """transformers' ``Qwen3MoeSparseMoeBlock`` (grouped_mm experts) holding copies of ``raymoe_block``'s
    weights, or None and the reason it could not be built."""
    try:
        import transformers
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

        config = qwen3_moe_config(shape, transformers)
        config._experts_implementation = "grouped_mm"
        block = Qwen3MoeSparseMoeBlock(config)
        weight = next(raymoe_block.parameters())
        block.to(weight.device, weight.dtype).train()
        with torch.no_grad():
            block.gate.weight.copy_(raymoe_block.gate.weight)
            block.experts.gate_up_proj.copy_(raymoe_block.experts.gate_up_proj)
            block.experts.down_proj.copy_(raymoe_block.experts.down_proj)
    except Exception as error:  # optional comparison: any failure skips it, with the reason
        return None, f"{type(error).__name__}: {error}"
    return block, ""


def time_block(block: nn.Module, x_BTH: Tensor, settings: Settings) -> list[float]:
    """Seconds of each timed forward + backward of ``block`` on ``x [1, T, H]`` (after the warm-up ones)."""
    grad_BTH = torch.randn_like(x_BTH)

    def forward_backward() -> None:
        block(x_BTH).backward(grad_BTH)

    seconds = []
    for i in range(settings.block_warmup + settings.block_iters):
        block.zero_grad(set_to_none=True)
        x_BTH.grad = None
        took = timed(forward_backward, settings.device)
        if i >= settings.block_warmup:
            seconds.append(took)
    return seconds


def block_row(seconds: list[float], flops: float, peak: float | None) -> dict[str, Any]:
    """Median and best time of the timed iterations as TFLOP/s and a percentage of ``peak``."""
    row: dict[str, Any] = {"iters": len(seconds), "median_ms": 1e3 * statistics.median(seconds)}
    row["best_ms"] = 1e3 * min(seconds)
    row["tflops_median"] = flops / statistics.median(seconds) / 1e12
    row["tflops_best"] = flops / min(seconds) / 1e12
    if peak is not None:
        row["pct_of_peak_median"] = 100.0 * row["tflops_median"] / peak
        row["pct_of_peak_best"] = 100.0 * row["tflops_best"] / peak
    return row


def dense_gemm(settings: Settings) -> dict[str, Any]:
    """TFLOP/s of a large square matmul in ``settings.dtype`` (8192^3 on a GPU, 512^3 on CPU smoke): the ceiling
    measured in this run, beside the datasheet's peak."""
    size = 512 if settings.smoke else 8192
    gen = torch.Generator(device=settings.device).manual_seed(SEED)
    a, b = (torch.randn(size, size, generator=gen, device=settings.device, dtype=settings.dtype) for _ in range(2))
    seconds = [timed(lambda: a @ b, settings.device) for _ in range(13)][3:]
    return {"size": size, "tflops_median": 2 * size**3 / statistics.median(seconds) / 1e12}


def run_block(shape: Shape, settings: Settings, peak: float | None) -> dict[str, Any]:
    """Part A: raymoe's block (and transformers' beside it, where it builds) on ``shape.block_tokens`` tokens."""
    from raymoe.models.moe import select_gemm_backend

    raymoe_block = build_raymoe_block(shape, settings)
    gen = torch.Generator(device=settings.device).manual_seed(SEED)
    x_BTH = torch.randn(
        1, shape.block_tokens, shape.hidden, generator=gen, device=settings.device, dtype=settings.dtype
    ).requires_grad_()
    experts = raymoe_block.experts
    flops = block_flops(shape, shape.block_tokens)
    result: dict[str, Any] = {
        "dense_gemm": dense_gemm(settings),
        "tokens": shape.block_tokens,
        "flops_per_iter": flops,
        "gemm_backend": select_gemm_backend(x_BTH[0], experts.gate_up_proj),
        "raymoe": block_row(time_block(raymoe_block, x_BTH, settings), flops, peak),
    }
    result.update(transformers_block(raymoe_block, x_BTH, shape, settings, peak))
    if settings.compile:
        try:
            result["raymoe compiled"] = block_row(time_block(torch.compile(raymoe_block), x_BTH, settings), flops, peak)
        except Exception as error:  # reported, so the rest of the check still runs
            result["raymoe compiled"] = {"skipped": f"{type(error).__name__}: {error}"}
    return result


def transformers_block(
    raymoe_block: nn.Module, x_BTH: Tensor, shape: Shape, settings: Settings, peak: float | None
) -> dict[str, Any]:
    """transformers' block with ``raymoe_block``'s weights: its timing row and the largest output difference
    on ``x [1, T, H]``; ``{"transformers": {"skipped": reason}}`` where it fails (the comparison is optional)."""
    theirs, why_not = build_transformers_block(raymoe_block, shape)
    if theirs is None:
        return {"transformers": {"skipped": why_not}}
    try:
        with torch.no_grad():
            difference = (raymoe_block(x_BTH) - theirs(x_BTH)).abs().max().item()
        row = block_row(time_block(theirs, x_BTH, settings), block_flops(shape, x_BTH.shape[1]), peak)
    except Exception as error:  # optional comparison: a failing forward skips it, with the reason
        return {"transformers": {"skipped": f"{type(error).__name__}: {error}"}}
    return {"max_abs_diff_outputs": difference, "transformers": row}


# --- part B: one-rank training --------------------------------------------------------------------


def qwen3_moe_config(shape: Shape, transformers: Any) -> Any:
    """transformers' ``Qwen3MoeConfig`` of ``shape`` (every layer sparse, top-k weights renormalised)."""
    return transformers.Qwen3MoeConfig(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        moe_intermediate_size=shape.moe_intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        num_experts=shape.experts,
        num_experts_per_tok=shape.top_k,
        norm_topk_prob=True,
        tie_word_embeddings=False,
    )


def write_checkpoint(directory: Path, shape: Shape, settings: Settings) -> None:
    """A random checkpoint of ``shape`` in ``settings.dtype``, written by transformers' ``save_pretrained``.

    The model is built on the meta device and filled on ``settings.device`` (normal(0, 0.02), norms 1):
    on a GPU that takes seconds where CPU initialisation of ~2B parameters takes a minute.
    """
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(
            qwen3_moe_config(shape, transformers), dtype=settings.dtype
        )
    model = model.to_empty(device=settings.device)
    gen = torch.Generator(device=settings.device).manual_seed(SEED)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.fill_(1.0)
            else:
                parameter.normal_(0.0, INIT_STD, generator=gen)
    model.save_pretrained(directory)
    del model
    release_memory(settings.device)


def release_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def token_batches(shape: Shape, count: int) -> list[Tensor]:
    """``count`` random ``input_ids [B, S]`` (CPU, seed 1): the same for both systems."""
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, shape.vocab, (shape.batch, shape.seq), generator=gen) for _ in range(count)]


class TransformersRun:
    """transformers in this process: ``from_pretrained`` (grouped_mm experts) on the device, torch AdamW."""

    name = "transformers"

    def __init__(self, directory: Path, settings: Settings) -> None:
        import transformers

        self.device = settings.device
        model = transformers.AutoModelForCausalLM.from_pretrained(
            directory, dtype=settings.dtype, experts_implementation="grouped_mm"
        )
        self.model = model.to(settings.device).train()
        # fused, as transformers' Trainer defaults to with torch >= 2.8 (and as raymoe's ranks step)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=1e-4, betas=(0.9, 0.999), weight_decay=0.0, fused=True
        )

    def step(self, ids_BS: Tensor) -> Tensor:
        """One AdamW step; the loss stays on the device (read after the round, not inside the timing)."""
        ids_BS = ids_BS.to(self.device)
        loss = self.model(input_ids=ids_BS, labels=ids_BS).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        synchronize(self.device)
        return loss.detach()

    def profile(self, steps: Callable[[], object]) -> dict[str, Any]:
        cuda = self.device.type == "cuda"
        with torch.profiler.profile(activities=profiler_activities(cuda)) as profiler:
            steps()
            synchronize(self.device)
        return profile_summary(profiler, cuda)

    def report(self) -> dict[str, Any]:
        if self.device.type != "cuda":
            return {"peak_memory_bytes": None}
        return {"peak_memory_bytes": torch.cuda.max_memory_allocated(self.device)}

    def close(self) -> None:
        del self.model, self.optimizer
        release_memory(self.device)


def rank_report(ctx: Any) -> dict[str, Any]:
    """Rank function (``DistributedModel.run_on_ranks``): the rank's backend, device and peak GPU memory."""
    import torch

    cuda = ctx.device.type == "cuda"
    return {
        "rank": ctx.rank,
        "backend": ctx.backend,
        "device": str(ctx.device),
        "device_name": torch.cuda.get_device_name(ctx.device) if cuda else "cpu",
        "peak_memory_bytes": torch.cuda.max_memory_allocated(ctx.device) if cuda else None,
    }


def ship_rank_functions() -> None:
    """This module's rank functions travel by value: imported (not run as a script), the ranks cannot import it."""
    import ray.cloudpickle

    if __name__ != "__main__":
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def rank_profile_start(ctx: Any) -> None:
    """Rank function: start torch's profiler (CPU, and CUDA on a GPU) on this rank."""
    import torch

    ctx.gpu_check_profiler = torch.profiler.profile(activities=profiler_activities(ctx.device.type == "cuda"))
    ctx.gpu_check_profiler.start()


def rank_profile_stop(ctx: Any) -> dict[str, Any]:
    """Rank function: stop the profiler :func:`rank_profile_start` started; its summary (:func:`profile_summary`)."""
    import torch

    profiler = ctx.gpu_check_profiler
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)
    profiler.stop()
    del ctx.gpu_check_profiler
    return profile_summary(profiler, ctx.device.type == "cuda")


def profiler_activities(cuda: bool) -> list[torch.profiler.ProfilerActivity]:
    """What torch's profiler records: host operators, and the kernels on a GPU."""
    cpu, kernels = torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA
    return [cpu, kernels] if cuda else [cpu]


def profile_summary(profiler: Any, cuda: bool, rows: int = 20) -> dict[str, Any]:
    """Kernel seconds (self device time of every operator: what the GPU was busy with; CPU: self CPU time) and the
    top ``rows`` operators by it, as torch's table."""
    averages = profiler.key_averages()
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    # on a GPU only the kernels' own rows: an operator's row and a profiler annotation repeat its kernels' time
    counted = [event for event in averages if not cuda or event.device_type != torch.autograd.DeviceType.CPU]
    busy_us = sum(getattr(event, key) for event in counted)
    return {"busy_s": busy_us / 1e6, "sorted_by": key, "table": averages.table(sort_by=key, row_limit=rows)}


def profile_steps(run: TransformersRun | RaymoeRun, batches: list[Tensor], steps: int) -> dict[str, Any]:
    """``steps`` more steps of ``run`` under torch's profiler (after its warm rounds): wall seconds (queued work
    drained: each ``profile`` synchronizes its device) against the seconds the device computed; their gap is launch
    overhead, host work, syncs and the profiler's own cost."""
    began = time.perf_counter()
    summary = run.profile(lambda: [run.step(ids) for ids in batches[:steps]])
    wall = time.perf_counter() - began
    return {"steps": steps, "wall_s": wall, **summary, "busy_over_wall": summary["busy_s"] / wall}


@dataclass(frozen=True)
class RaymoeRow:
    """One raymoe row of the training part: compiled decoder blocks or not, and the precision policy (None: the
    default of a bf16 checkpoint, bf16-mixed: fp32 masters)."""

    name: str
    compiled: bool
    precision: str | None = None


def raymoe_rows(settings: Settings) -> list[RaymoeRow]:
    rows = [RaymoeRow("raymoe", compiled=False)]
    if settings.compile:
        rows.append(RaymoeRow("raymoe compiled", compiled=True))
    if (
        settings.pure and settings.dtype == torch.bfloat16
    ):  # transformers' own setting (bf16 weights and AdamW states): like for like
        rows.append(
            RaymoeRow(
                "raymoe compiled bf16-pure" if settings.compile else "raymoe bf16-pure",
                compiled=settings.compile,
                precision="bf16-pure",
            )
        )
    return rows


class RaymoeRun:
    """raymoe on a local Ray: ``from_pretrained(world_size=1)`` (one rank actor, one GPU where Ray has one),
    AdamW via ``configure_training`` with the same settings as :class:`TransformersRun`."""

    def __init__(self, directory: Path, settings: Settings, row: RaymoeRow) -> None:
        import ray

        import raymoe

        if not ray.is_initialized():
            # A fresh local instance (never another one running here); no dashboard: nothing of it is needed.
            ray.init(
                address="local",
                num_cpus=max(2, os.cpu_count() or 2),
                num_gpus=torch.cuda.device_count(),
                include_dashboard=False,
                log_to_driver=False,
            )
        self.name = row.name
        self.compiled = row.compiled
        began = time.perf_counter()
        self.model = raymoe.from_pretrained(
            directory, world_size=1, dtype=settings.dtype, compile=row.compiled, precision=row.precision
        )
        self.load_s = time.perf_counter() - began
        self.precision = self.model.precision.describe()
        self.compile_s = 0.0
        self.model.configure_training(
            lr=1e-4, betas=(0.9, 0.999), weight_decay=0.0, max_grad_norm=None, telemetry=settings.telemetry
        )

    def step(self, ids_BS: Tensor) -> float:
        # returns once the rank has taken the step (its loss is in the answer)
        metrics = self.model.train_step(ids_BS)
        self.compile_s += metrics.get("compile_s", 0.0)
        return float(metrics["loss"])

    def profile(self, steps: Callable[[], object]) -> dict[str, Any]:
        ship_rank_functions()
        self.model.run_on_ranks(rank_profile_start)
        try:
            steps()
        finally:
            ranks = self.model.run_on_ranks(rank_profile_stop)
        return ranks[0]

    def report(self) -> dict[str, Any]:
        ship_rank_functions()
        ranks = self.model.run_on_ranks(rank_report)
        report = {
            "peak_memory_bytes": ranks[0]["peak_memory_bytes"],
            "ranks": ranks,
            "precision": self.precision,
            "load_s": self.load_s,
        }
        return {**report, "compile_s": self.compile_s} if self.compiled else report

    def close(self, keep_ray: bool = False) -> None:
        import ray

        self.model.shutdown()
        if not keep_ray:
            ray.shutdown()


def time_steps(
    run: TransformersRun | RaymoeRun, batches: list[Tensor], settings: Settings
) -> tuple[float, list[float]]:
    """Label tokens per second of one round (warm-up steps, then the median of the timed ones) and its losses."""
    losses: list[Tensor | float] = []
    seconds = [timed(lambda ids=ids: losses.append(run.step(ids)), torch.device("cpu")) for ids in batches]
    timed_seconds = seconds[settings.train_warmup :]
    batch, seq = batches[0].shape
    return batch * (seq - 1) / statistics.median(timed_seconds), [float(loss) for loss in losses]


def run_train(shape: Shape, settings: Settings) -> dict[str, Any]:
    """Part B: transformers and raymoe's first row loaded, then ``settings.rounds`` alternating timed rounds (best
    round each); then each further raymoe row in the previous one's place (one GPU holds one rank), alternating
    with transformers again. Every system starts from the same checkpoint and steps the same batches: the first
    round's losses are compared (the first step's on equal weights; later ones drift with the precision)."""
    batches = token_batches(shape, settings.train_warmup + settings.train_steps)
    rows = raymoe_rows(settings)
    speeds: dict[str, list[float]] = {"transformers": [], **{row.name: [] for row in rows}}
    losses: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        began = time.perf_counter()
        write_checkpoint(Path(tmp), shape, settings)
        checkpoint_s = time.perf_counter() - began
        runs: list[TransformersRun | RaymoeRun] = [TransformersRun(Path(tmp), settings)]
        reports: dict[str, dict[str, Any]] = {}
        try:
            for row in rows:
                if len(runs) > 1:  # the previous raymoe rank gives its GPU back first
                    previous = runs.pop()
                    assert isinstance(previous, RaymoeRun)
                    previous.close(keep_ray=True)
                runs.append(RaymoeRun(Path(tmp), settings, row))
                for round_index in range(settings.rounds):
                    for run in runs:
                        speed, round_losses = time_steps(run, batches, settings)
                        speeds[run.name].append(speed)
                        losses.setdefault(run.name, round_losses)
                        print(
                            f"  train round {round_index + 1}: {run.name:<26}{speed:>12.0f} tokens/s, "
                            f"first loss {round_losses[0]:.4f}"
                        )
                reports.update({run.name: run.report() for run in runs})
                if settings.profile_steps:
                    for run in runs:
                        profiled = profile_steps(run, batches, settings.profile_steps)
                        reports[run.name]["profile"] = profiled
                        print(
                            f"  profile {run.name}: {profiled['steps']} steps in {profiled['wall_s']:.2f} s, "
                            f"device busy {profiled['busy_s']:.2f} s ({profiled['busy_over_wall']:.0%})\n"
                            f"{profiled['table']}"
                        )
        finally:
            for run in reversed(runs):
                run.close()
    result: dict[str, Any] = {
        "batch": shape.batch,
        "seq": shape.seq,
        "label_tokens_per_step": shape.batch * (shape.seq - 1),
        "warmup_steps": settings.train_warmup,
        "timed_steps": settings.train_steps,
        "checkpoint_write_s": checkpoint_s,
        "raymoe_telemetry": settings.telemetry,
    }
    reference = speeds["transformers"]
    for name, rounds in speeds.items():
        result[name] = {
            "tokens_per_s": max(rounds),
            "tokens_per_s_rounds": rounds,
            "first_round_losses": losses[name],
            **reports[name],
        }
        if name != "transformers":
            result[name]["over_transformers"] = max(rounds) / max(reference)
            result[name]["first_loss_minus_transformers"] = losses[name][0] - losses["transformers"][0]
    result["ratio_raymoe_over_transformers"] = result["raymoe"]["over_transformers"]
    if settings.compile:
        compiled_speed = result["raymoe compiled"]["tokens_per_s"]
        result["ratio_raymoe_compiled_over_transformers"] = result["raymoe compiled"]["over_transformers"]
        result["ratio_raymoe_compiled_over_eager"] = compiled_speed / result["raymoe"]["tokens_per_s"]
    return result


# --- output ---------------------------------------------------------------------------------------


def gib(value: int | None) -> str:
    return "n/a" if value is None else f"{value / 2**30:.2f} GiB"


def percent(row: dict[str, Any], key: str) -> str:
    return f"{row[key]:.1f}%" if key in row else "n/a"


def print_block(block: dict[str, Any], peak: float | None, peak_note: str) -> None:
    print(f"\nA. MoE block forward+backward, {block['tokens']} tokens, grouped GEMM backend {block['gemm_backend']}")
    print(f"   peak: {'n/a' if peak is None else f'{peak:.0f} TFLOP/s'} ({peak_note})")
    gemm = block["dense_gemm"]
    print(f"   measured: {gemm['size']}^3 matmul at {gemm['tflops_median']:.4g} TFLOP/s (median of 10)")
    print(f"   {'system':<14}{'median ms':>10}{'TFLOP/s':>10}{'% peak':>8}{'best ms':>10}{'TFLOP/s':>10}{'% peak':>8}")
    for name in ("raymoe", "transformers", "raymoe compiled"):
        if name not in block:
            continue
        row = block[name]
        if "skipped" in row:
            print(f"   {name:<14}skipped: {row['skipped']}")
            continue
        print(
            f"   {name:<14}{row['median_ms']:>10.2f}{row['tflops_median']:>10.4g}"
            f"{percent(row, 'pct_of_peak_median'):>8}"
            f"{row['best_ms']:>10.2f}{row['tflops_best']:>10.4g}{percent(row, 'pct_of_peak_best'):>8}"
        )
    if "max_abs_diff_outputs" in block:
        print(f"   same weights and input: max |raymoe - transformers| = {block['max_abs_diff_outputs']:.3g}")


def print_train(train: dict[str, Any]) -> None:
    print(f"\nB. one-rank training, batch {train['batch']}x{train['seq']}, best of the rounds")
    print(f"   {'system':<28}{'tokens/s':>12}{'/ transformers':>16}{'peak memory':>14}{'first loss':>12}")
    names = [name for name, row in train.items() if isinstance(row, dict) and "tokens_per_s" in row]
    for name in names:
        row = train[name]
        ratio = f"{row['over_transformers']:.2f}" if "over_transformers" in row else ""
        extra = f"   compiled in {row['compile_s']:.0f} s" if "compile_s" in row else ""
        extra += f"   ({row['precision']})" if "precision" in row else ""
        print(
            f"   {name:<28}{row['tokens_per_s']:>12.0f}{ratio:>16}{gib(row['peak_memory_bytes']):>14}"
            f"{row['first_round_losses'][0]:>12.4f}{extra}"
        )
    ranks = train["raymoe"].get("ranks") or [{}]
    print(f"   raymoe rank 0: backend {ranks[0].get('backend')}, device {ranks[0].get('device')}")
    if "ratio_raymoe_compiled_over_eager" in train:
        print(f"   raymoe compiled / raymoe eager = {train['ratio_raymoe_compiled_over_eager']:.2f}")


# --- command line ---------------------------------------------------------------------------------


def default_out() -> Path:
    out = os.environ.get("OUT")
    return Path(out) / "gpu_check.json" if out else Path("gpu_check.json")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes; CPU fp32 without a GPU")
    parser.add_argument(
        "--parts",
        nargs="+",
        choices=["block", "train", "readiness", "context"],
        default=["block", "train", "readiness", "context"],
    )
    parser.add_argument("--block-tokens", type=int, help="tokens of the block part (default 8192; smoke 256)")
    parser.add_argument("--batch", type=int, help="training rows per step (default 4; smoke 2)")
    parser.add_argument("--seq", type=int, help="training sequence length (default 2048; smoke 32)")
    parser.add_argument("--block-warmup", type=int, default=5)
    parser.add_argument("--block-iters", type=int, default=20)
    parser.add_argument("--train-warmup", type=int, default=3)
    parser.add_argument("--train-steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2, help="alternating training rounds; each keeps its best")
    parser.add_argument("--telemetry", action="store_true", help="raymoe records routing telemetry each step")
    parser.add_argument(
        "--compile", action=argparse.BooleanOptionalAction, default=True, help="the compiled rows too (default: on)"
    )
    parser.add_argument(
        "--pure",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also raymoe in bf16-pure (bf16 weights and AdamW states, as transformers trains here; default: on)",
    )
    parser.add_argument(
        "--profile-steps",
        type=int,
        default=0,
        help="train: profile this many more steps of each system (kernel time against wall time, top operators)",
    )
    parser.add_argument("--peak-tflops", type=float, help="the GPU's dense bf16 peak, instead of the name table")
    parser.add_argument("--out", type=Path, default=default_out(), help="JSON file of every figure")
    args = parser.parse_args(argv)
    for name in ("block_tokens", "batch", "seq", "block_iters", "train_steps", "rounds"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.seq is not None and args.seq < 2:
        parser.error("--seq must be >= 2 (the loss needs a next token)")
    return args


def settings_and_shape(args: argparse.Namespace) -> tuple[Settings, Shape]:
    """bf16 on the GPU; without one only ``--smoke`` runs (fp32 on CPU). Smoke mode: tiny shapes, 2 steps."""
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        raise SystemExit(
            "gpu_check: this check needs a CUDA GPU and none is visible (torch.cuda.is_available() is False); "
            "run with --smoke to exercise the code paths on CPU with tiny shapes"
        )
    shape = SMOKE if args.smoke else FULL
    overrides = {"block_tokens": args.block_tokens, "batch": args.batch, "seq": args.seq}
    shape = replace(shape, **{k: v for k, v in overrides.items() if v is not None})
    settings = Settings(
        device=torch.device("cuda") if cuda else torch.device("cpu"),
        dtype=torch.bfloat16 if cuda else torch.float32,
        smoke=args.smoke,
        block_warmup=1 if args.smoke else args.block_warmup,
        block_iters=2 if args.smoke else args.block_iters,
        train_warmup=1 if args.smoke else args.train_warmup,
        train_steps=2 if args.smoke else args.train_steps,
        rounds=args.rounds,
        telemetry=args.telemetry,
        compile=args.compile,
        pure=args.pure,
        profile_steps=args.profile_steps,
    )
    return settings, shape


def environment(settings: Settings) -> dict[str, Any]:
    """Device and library versions of this run."""
    import transformers

    info: dict[str, Any] = {
        "device": settings.device.type,
        "device_name": torch.cuda.get_device_name(settings.device) if settings.device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "python": sys.version.split()[0],
        "dtype": str(settings.dtype).removeprefix("torch."),
    }
    try:
        import ray

        info["ray"] = ray.__version__
    except ImportError:
        info["ray"] = None
    return info


def run_part(part: str, shape: Shape, settings: Settings, peak: float | None, peak_note: str) -> dict[str, Any]:
    """One part's figures (printed as they come)."""
    if part == "block":
        block = run_block(shape, settings, peak)
        print_block(block, peak, peak_note)
        return block
    if part == "train":
        train = run_train(shape, settings)
        print_train(train)
        return train
    if part == "readiness":
        return run_readiness(settings.device)
    print("\nring attention's block kernels against float64 attention (issue 32)")
    return run_context(settings.device)


def write_result(out: Path, result: dict[str, Any]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    settings, shape = settings_and_shape(args)
    env = environment(settings)
    peak, peak_note = peak_tflops(settings.device, args.peak_tflops)
    print(
        f"gpu_check on {env['device_name']} ({env['dtype']}), torch {env['torch']}, transformers {env['transformers']}"
    )
    if settings.smoke:
        print("SMOKE MODE: tiny shapes, few iterations: the figures below are not meaningful")
    result: dict[str, Any] = {
        **env,
        "smoke": settings.smoke,
        "shape": asdict(shape),
        "settings": {k: v for k, v in asdict(settings).items() if k not in ("device", "dtype")},
        "peak_bf16_tflops": peak,
        "peak_note": peak_note,
    }
    for part in ("block", "train", "readiness", "context"):
        if part not in args.parts:
            continue
        release_memory(settings.device)
        began = time.perf_counter()
        try:
            result[part] = run_part(part, shape, settings, peak, peak_note)
        except Exception as error:  # a failing part is a finding: the others still run, the JSON says why
            traceback.print_exc()
            result[part] = {"error": f"{type(error).__name__}: {error}"}
            print(f"\n{part}: FAILED: {result[part]['error']}")
        result.setdefault("part_seconds", {})[part] = time.perf_counter() - began
        write_result(args.out, result)  # after every part: a run stopped at its time limit keeps what it had
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
