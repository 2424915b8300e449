"""The readiness part of the GPU check (issue 36): one rank in this process (``raymoe.LocalRankGroup``), tiny bf16
checkpoints written here, each path of issue 36 run once and its host syncs counted two ways.

    precision     the default policy of a bf16 checkpoint (fp32 masters, bf16 compute through FSDP2): 4 steps
    accumulation  4 micro-batches: peak memory against 1 micro-batch (gradients stay sharded)
    offload       fsdp_cpu_offload with bias balancing (DeepSeek-V3): the selection bias moves, stays fp32
    states        async save_state, load_state: peak memory of the load against the state's bytes
    generate      32 tokens: syncs per token, ms per token early and late

Syncs are counted by the meter the CPU tests use (``raymoe.rank.host_syncs.HostSyncs``) and, on CUDA, by
``torch.cuda.set_sync_debug_mode("warn")`` (one warning per synchronizing call). Run through gpu_check.py
(``--parts readiness``); on CPU (``--smoke``) every figure but the memory ones is the meter's.
"""

from __future__ import annotations

import itertools
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

STEPS, ROWS, SEQ, NEW_TOKENS = 4, 4, 64, 32


def run_readiness(device: torch.device) -> dict[str, Any]:
    """Every readiness figure, as a JSON-able dict (a failing part records its error and the others still run)."""
    import transformers

    from raymoe.rank.local import LocalRankGroup

    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        moe, deepseek = Path(tmp) / "moe", Path(tmp) / "deepseek"
        _tiny(transformers, "qwen3_moe").save_pretrained(moe)
        _tiny(transformers, "deepseek_v3").save_pretrained(deepseek)
        world = LocalRankGroup()
        try:
            for name, part in (
                ("precision", lambda: _precision(world, moe, device)),
                ("accumulation", lambda: _accumulation(world, moe, device)),
                ("offload", lambda: _offload(world, deepseek, device)),
                ("states", lambda: _states(world, moe, Path(tmp) / "state", device)),
                ("generate", lambda: _generate(world, moe, device)),
            ):
                results[name] = _guarded(part)
                print(f"readiness {name}: {results[name]}", flush=True)
        finally:
            world.shutdown()
    return results


def _tiny(transformers: Any, family: str) -> Any:
    """A small random bf16 model of ``family`` (sizes a GPU runs in milliseconds)."""
    common = {"vocab_size": 512, "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4}
    if family == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(
            **common, intermediate_size=512, moe_intermediate_size=128, num_key_value_heads=2, head_dim=64,
            num_experts=16, num_experts_per_tok=4,
        )  # fmt: skip
    else:
        config = transformers.DeepseekV3Config(
            **common, intermediate_size=512, moe_intermediate_size=128, num_key_value_heads=4, q_lora_rank=None,
            kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=16,
            num_experts_per_tok=4, n_group=1, topk_group=1, first_k_dense_replace=0,
        )  # fmt: skip
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16)


def _guarded(part: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    try:
        return part()
    except Exception as error:  # a readiness part that fails is a finding, not the end of the check
        return {"error": f"{type(error).__name__}: {error}"}


def _counted(device: torch.device, fn: Callable[[], Any]) -> tuple[Any, int, int]:
    """``(fn(), meter syncs, CUDA sync warnings)`` (the warnings only on CUDA)."""
    from raymoe.rank.host_syncs import HostSyncs

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode("warn")
        try:
            with HostSyncs() as meter:
                result = fn()
        finally:
            if device.type == "cuda":
                torch.cuda.set_sync_debug_mode("default")
    cuda_syncs = sum("synchroniz" in str(w.message) for w in caught)
    return result, meter.count, cuda_syncs


def _batch(rows: int = ROWS, seq: int = SEQ) -> torch.Tensor:
    return torch.randint(0, 512, (rows, seq), generator=torch.Generator().manual_seed(0))


def _precision(world: Any, checkpoint: Path, device: torch.device) -> dict[str, Any]:
    import raymoe
    from raymoe.rank.contract import MicroBatch
    from raymoe.rank.train import train_step

    with raymoe.from_pretrained(checkpoint, world=world) as model:
        model.configure_training(lr=1e-5)
        losses = [model.train_step(_batch())["loss"] for _ in range(STEPS)]
        ids = _batch()
        micro = MicroBatch(ids, ids.clone(), torch.ones_like(ids, dtype=torch.bool))

        def step(ctx: Any) -> tuple[int, int]:
            _, meter, cuda = _counted(ctx.device, lambda: train_step(ctx, [micro], ids.numel()))
            return meter, cuda

        (meter, cuda), *_ = model.run_on_ranks(step)
        return {"policy": model.precision.describe(), "losses": losses, "syncs_per_step": meter, "cuda_syncs": cuda}


def _peak_of(device: torch.device, fn: Callable[[], Any]) -> int:
    """Peak bytes allocated on ``device`` during ``fn`` above what was allocated before it (CUDA; -1 elsewhere)."""
    if device.type != "cuda":
        fn()
        return -1
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    return int(torch.cuda.max_memory_allocated(device) - before)


def _accumulation(world: Any, checkpoint: Path, device: torch.device) -> dict[str, Any]:
    import raymoe
    from raymoe.rank.contract import MicroBatch
    from raymoe.rank.train import train_step

    ids = _batch(8)

    def peak(ctx: Any, pieces: int) -> int:
        micro = [MicroBatch(p, p.clone(), torch.ones_like(p, dtype=torch.bool)) for p in ids.chunk(pieces)]
        train_step(ctx, micro, ids.numel())
        return _peak_of(ctx.device, lambda: train_step(ctx, micro, ids.numel()))

    with raymoe.from_pretrained(checkpoint, world=world) as model:
        model.configure_training(lr=1e-5)
        one, four = model.run_on_ranks(peak, 1)[0], model.run_on_ranks(peak, 4)[0]
    return {"peak_1_micro_batch": one, "peak_4_micro_batches": four, "ratio": four / one if one > 0 else None}


def _offload(world: Any, checkpoint: Path, device: torch.device) -> dict[str, Any]:
    import raymoe

    def biases(ctx: Any) -> list[torch.Tensor]:
        from torch.distributed.tensor import DTensor

        modules = ctx.require_model().model.modules()
        found = [m.e_score_correction_bias for m in modules if getattr(m, "e_score_correction_bias", None) is not None]
        return [(b.full_tensor() if isinstance(b, DTensor) else b).detach().cpu().clone() for b in found]

    layout = raymoe.DistributedConfig(fsdp_cpu_offload=True)
    with raymoe.from_pretrained(checkpoint, distributed_config=layout, world=world) as model:
        before = model.run_on_ranks(biases)[0]
        model.configure_training(lr=1e-5, balance="bias", bias_update_rate=1e-3)
        for _ in range(2):
            model.train_step(_batch())
        after = model.run_on_ranks(biases)[0]
    moved = max(float((a - b).abs().max()) for a, b in zip(after, before, strict=True))
    return {"bias_dtypes": sorted({str(b.dtype) for b in after}), "largest_move": moved}


def _states(world: Any, checkpoint: Path, path: Path, device: torch.device) -> dict[str, Any]:
    """The rank runs in this process, so the device's peak around the driver's ``load_state`` is the rank's."""
    import raymoe

    with raymoe.from_pretrained(checkpoint, world=world) as model:
        model.configure_training(lr=1e-5)
        model.train_step(_batch())
        start = time.perf_counter()
        model.save_state(path, async_save=True)
        returned = time.perf_counter() - start
        model.wait_for_save()
        written = time.perf_counter() - start
        held = sum(model.run_on_ranks(_state_bytes))
        peak = _peak_of(device, lambda: model.load_state(path))
    return {"async_save_returned_s": returned, "async_save_written_s": written, "load_peak": peak, "state_bytes": held}


def _state_bytes(ctx: Any) -> int:
    return sum(_bytes(t) for t in _state_tensors(ctx))


def _state_tensors(ctx: Any) -> list[torch.Tensor]:
    from torch.distributed.tensor import DTensor

    loaded = ctx.require_model()
    tensors = [p for part in loaded.parts for p in part.parameters()]
    for state in loaded.require_training().optimizer.state.values():
        tensors += [t for t in state.values() if isinstance(t, torch.Tensor)]
    return [t.to_local() if isinstance(t, DTensor) else t for t in tensors]


def _bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _generate(world: Any, checkpoint: Path, device: torch.device) -> dict[str, Any]:
    import raymoe

    prompts = _batch(4, 16).tolist()
    with raymoe.from_pretrained(checkpoint, world=world) as model:
        model.generate(prompts, 4)  # warm-up
        start = time.perf_counter()
        _, meter, cuda = _counted(device, lambda: model.generate(prompts, NEW_TOKENS, do_sample=True, seed=0))
        seconds = time.perf_counter() - start
        stream = model.generate_stream(prompts, 256)
        times = []
        for _ in stream:
            times.append(time.perf_counter())
    gaps = [b - a for a, b in itertools.pairwise(times)]
    early, late = gaps[:16], gaps[-16:]
    return {
        "syncs_per_token": meter / NEW_TOKENS,
        "cuda_syncs_per_token": cuda / NEW_TOKENS,
        "ms_per_token": 1e3 * seconds / NEW_TOKENS,
        "stream_ms_per_token_early": 1e3 * sum(early) / max(len(early), 1),
        "stream_ms_per_token_late": 1e3 * sum(late) / max(len(late), 1),
    }
