"""Long sequences (issue 32): context parallelism and sequence parallelism against one rank, side by side in one run.

One wide, shallow Qwen3-MoE (``FULL``: 2 layers, hidden 1024, 16 heads / 4 kv heads of 64, 8 experts top-2 of
moe_intermediate 512, vocabulary 2048; random weights written by transformers' ``save_pretrained`` in fp32 into a
temporary directory, nothing downloaded; the run prints the dimensions) trains one row of ``S`` tokens (batch 1)
with AdamW, precision fp32, on CPU, under each layout (``LAYOUTS``), each on a ``raymoe.start_world`` Ray world of
its size (one actor per rank, one CPU and one torch thread each; ``raymoe.from_pretrained(..., world=...)``):

    cp1              world 1: the whole row on one rank (the reference)
    cp2, cp4         cp_size 2 / 4, ring attention (the default cp_mode): each rank holds 1 / cp of the row (the
                     load-balanced head-tail chunks); FSDP2 shards the parameters over the cp ranks
    cp2 all_to_all,  the same split, attention by all-to-all between sequence and heads (Ulysses)
    cp4 all_to_all
    tp2              tp_size 2: every rank holds the whole row; attention heads and experts split over the ranks
    tp2+sp           tp_size 2, enable_sequence_parallel=True: norms and the residual stream split along the
                     sequence over the tp ranks as well (a layout that fails to load or train is a row
                     "failed: <reason>", and the run goes on)

at ``S`` = 4096, 16384 and 32768 tokens (``--lengths``; a multiple of 2 x cp). A layout loads once: configure
AdamW (lr 1e-4, the defaults otherwise), one warm-up ``train_step`` at the shortest length (the AdamW moments
exist from there on); then, at each length in turn, shortest first:

    memory      on every rank (``model.run_on_ranks``), one training step (raymoe's rank-side ``train_step`` on the
                row, the same rows on every rank, as the driver sends them) measured as :mod:`bench_lora` measures
                it (its ``_held_bytes`` and ``_allocated_beyond``):
                  held          bytes of the storages the rank holds when the step begins: parameters, buffers,
                                AdamW moments (each storage once)
                  step growth   the most tensor bytes the step allocates beyond them at once (activations,
                                gradients, all-gathered weights, ring / all-to-all buffers, the logits and their
                                log-softmax, temporaries): the running sum in time order of torch's profiler's
                                allocation records on CPU (``torch.cuda.max_memory_allocated`` on a GPU). Tensor
                                bytes, not RSS (a rank process's ~300 MiB baseline of Python, torch and Ray is
                                not in them)
                  step peak     held + step growth
                the table shows the largest rank's value of each column. This step is also the length's warm-up
                for the timing
    tokens/s    label tokens (``S - 1``) per second of a driver ``model.train_step(ids)``, the median of ``--steps``
                steps (3 / 2 / 1 at 4k / 16k / 32k: a 32k step at cp1 takes about 5 minutes on one core)

Compared within the run: step growth of each cp row against cp1 at the same length, of tp2+sp against tp2.
The longest sequence that trains in 8 GiB (``--budget-gib``) per rank is **extrapolated**, not measured: per
layout, a least-squares line ``peak(S) = a + b * S`` through the measured largest-rank step peaks at the lengths
(the attention kernels, fused SDPA blocks with their log-sum-exp, hold memory linear in ``S``), solved for
``peak = 8 GiB``. ``--verify`` then trains cp1 at that length (rounded down to 1024) once and reports the measured
peak beside the prediction (slow: that step is longer than a 32k one).

Memory and time of a full run, estimated from cp1 / cp2 / cp4 / tp2 at 2k and 4k (growth grows linearly: cp1
~185 KiB a token, cp2 ~82 KiB + ~190 MiB, cp4 ~37 KiB + ~200 MiB, tp2 ~145 KiB): the largest rank peaks at
~6.4 GiB of tensors (cp1 at 32k), the machine at ~11 GiB in all (tp2 at 32k: two ranks of ~4.9 GiB, plus each
process's baseline); ``--verify`` holds ~8 GiB on its one rank. The 32k rows take most of the time.

    .venv/bin/python benchmarks/bench_long.py            # the committed table: about 1-1.5 h on 2 idle cores
    .venv/bin/python benchmarks/bench_long.py --verify   # and the cp1 check of the 8 GiB length (~10 min more)
    .venv/bin/python benchmarks/bench_long.py --quick    # ~2 min smoke run: a narrow model at 512 / 1024 / 2048
    .venv/bin/python benchmarks/bench_long.py --report   # rewrite bench_long.md from bench_long.json

A full run writes ``--out`` (default benchmarks/results)/bench_long.json and bench_long.md, after every row;
``--quick`` writes to a fresh temporary directory unless ``--out`` is given. Not run by the test suite.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import bench_lora
import torch
from bench_lora import _allocated_beyond, _held_bytes, release_memory

MIB = 2**20
GIB = 2**30
LENGTHS = [4096, 16384, 32768]
QUICK_LENGTHS = [512, 1024, 2048]
STEPS = [3, 2, 1]  # timed steps at each length (after the profiled one, the length's warm-up)
QUICK_STEPS = [2, 2, 2]

# name -> DistributedConfig fields; the world is cp_size * tp_size ranks. In the tables' order; run by world size.
LAYOUTS: dict[str, dict[str, Any]] = {
    "cp1": {},
    "cp2": {"cp_size": 2},
    "cp2 all_to_all": {"cp_size": 2, "cp_mode": "all_to_all"},
    "cp4": {"cp_size": 4},
    "cp4 all_to_all": {"cp_size": 4, "cp_mode": "all_to_all"},
    "tp2": {"tp_size": 2},
    "tp2+sp": {"tp_size": 2, "enable_sequence_parallel": True},
}


def world_of(config: dict[str, Any]) -> int:
    return int(config.get("cp_size", 1)) * int(config.get("tp_size", 1))


def reference_of(layout: str) -> str | None:
    """The layout a row's step growth is compared with: tp2 for tp2+sp, cp1 for the others."""
    return None if layout == "cp1" else "tp2" if layout == "tp2+sp" else "cp1"


# --- the model ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Dims:
    """The Qwen3-MoE's dimensions (every layer sparse; untied head)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int
    top_k: int
    moe_intermediate: int
    vocab: int
    max_positions: int = 131072

    def params(self) -> int:
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        attention = h * q + 2 * h * kv + q * h + 2 * self.head_dim  # q, k, v, o + the q / k norms
        experts = self.experts * 3 * self.moe_intermediate * h + self.experts * h  # gate_up, down + the router
        return self.layers * (attention + experts + 2 * h) + 2 * self.vocab * h + h

    def describe(self) -> str:
        return (
            f"Qwen3-MoE, {self.layers} layers, hidden {self.hidden}, {self.heads} heads / {self.kv_heads} kv heads of "
            f"{self.head_dim}, {self.experts} experts top-{self.top_k} (moe_intermediate {self.moe_intermediate}), "
            f"vocabulary {self.vocab}, max_position_embeddings {self.max_positions}; "
            f"{self.params() / 1e6:.1f} M parameters, fp32"
        )


FULL = Dims(
    hidden=1024, layers=2, heads=16, kv_heads=4, head_dim=64, experts=8, top_k=2, moe_intermediate=512, vocab=2048
)
QUICK = replace(FULL, hidden=256, heads=8, head_dim=32, moe_intermediate=128, vocab=512)


def save_model(directory: Path, dims: Dims) -> Path:
    """A random fp32 checkpoint of ``dims`` written by transformers (seed 0)."""
    import transformers

    config = transformers.Qwen3MoeConfig(
        vocab_size=dims.vocab, hidden_size=dims.hidden, intermediate_size=4 * dims.hidden,
        moe_intermediate_size=dims.moe_intermediate, num_hidden_layers=dims.layers,
        num_attention_heads=dims.heads, num_key_value_heads=dims.kv_heads, head_dim=dims.head_dim,
        num_experts=dims.experts, num_experts_per_tok=dims.top_k, norm_topk_prob=True,
        max_position_embeddings=dims.max_positions, tie_word_embeddings=False,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.save_pretrained(directory)
    return directory


# --- on the ranks -------------------------------------------------------------------------------------------------


def one_thread(ctx: Any) -> int:
    torch.set_num_threads(1)
    return torch.get_num_threads()


def rank_memory(ctx: Any, seq: int, vocab: int) -> dict[str, Any]:
    """Held bytes and one training step's growth on this rank (module docstring), on a row of ``seq`` tokens: the
    same row on every rank (a cp or tp group shares its batch: the decoder cuts each rank's share of it)."""
    import torch
    from torch.distributed.tensor import DTensor

    from raymoe.rank.contract import MicroBatch
    from raymoe.rank.train import train_step

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if isinstance(t, DTensor) else t

    loaded = ctx.require_model()
    ids = torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(seq))
    pieces = [MicroBatch(ids, ids.clone(), torch.ones_like(ids, dtype=torch.bool))]
    held = _held_bytes(loaded, local)
    began = time.perf_counter()
    growth = _allocated_beyond(lambda: train_step(ctx, pieces, float(seq - 1)), ctx.device)
    seconds = time.perf_counter() - began
    release_memory(ctx)
    return {
        "rank": ctx.rank,
        "threads": torch.get_num_threads(),
        "held_bytes": held,
        "step_growth_bytes": growth,
        "step_peak_bytes": held + growth,
        "profiled_step_s": seconds,
    }


# --- on the driver ------------------------------------------------------------------------------------------------


@dataclass
class Row:
    """One (layout, length): every rank's memory, the timed steps, or the error."""

    layout: str
    seq: int
    world: int
    config: dict[str, Any]
    ranks: list[dict[str, Any]] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    tokens_per_s: float = 0.0
    load_average: float = 0.0  # 1-minute, at the row's end
    error: str | None = None

    def largest(self, key: str) -> int:
        return max(int(rank[key]) for rank in self.ranks)

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.ranks)


def one_line(exc: BaseException) -> str:
    """A failure's type and the line of its message that names the error (Ray wraps a rank's in its traceback)."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()] or [""]
    named = [line for line in lines if "Error" in line or "error" in line]
    return f"{type(exc).__name__}: {(named or lines)[-1][:240]}"


def failed_text(error: str | None) -> str:
    return error if error and error.startswith("not run") else f"failed: {error}"


class Worlds:
    """One Ray world at a time, of the size asked; started again when a rank failure ended it."""

    def __init__(self, collective_timeout_s: float) -> None:
        self.timeout = collective_timeout_s
        self.size = 0
        self.group: Any = None
        self.threads: dict[int, list[int]] = {}

    def get(self, size: int) -> Any:
        import raymoe

        if self.group is not None and (self.size != size or not self.group.is_alive):
            self.close()
        if self.group is None:
            self.group = raymoe.start_world(size, cpus_per_rank=1.0, collective_timeout_s=self.timeout)
            self.size = size
            self.threads[size] = self.group.execute(one_thread)
        return self.group

    def close(self) -> None:
        if self.group is not None:
            self.group.shutdown()
        self.group, self.size = None, 0


def load(directory: Path, name: str, world: Any, vocab: int, warm_length: int) -> Any:
    """The layout loaded onto ``world``, AdamW configured, one warm-up step at ``warm_length`` taken."""
    import raymoe

    config = raymoe.DistributedConfig(**LAYOUTS[name])
    model = raymoe.from_pretrained(directory, distributed_config=config, world=world)
    try:
        model.configure_training(lr=1e-4)
        model.train_step(torch.randint(0, vocab, (1, warm_length), generator=torch.Generator().manual_seed(0)))
    except BaseException:
        model.shutdown()
        raise
    return model


def shut_down(model: Any) -> None:
    """Unload ``model``; after a rank failure the world is gone already (Worlds.get starts a new one)."""
    try:
        model.shutdown()
    except Exception as exc:
        print(f"  (shutdown after the failure: {one_line(exc)})", flush=True)


def measure_row(model: Any, row: Row, dims: Dims, steps: int) -> None:
    row.ranks = model.run_on_ranks(rank_memory, row.seq, dims.vocab)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        ids = torch.randint(0, dims.vocab, (1, row.seq), generator=gen)
        start = time.perf_counter()
        model.train_step(ids)
        row.step_seconds.append(time.perf_counter() - start)
    row.tokens_per_s = (row.seq - 1) / statistics.median(row.step_seconds)
    model.run_on_ranks(release_memory)


def measure_layout(name: str, directory: Path, dims: Dims, worlds: Worlds, args: argparse.Namespace) -> list[Row]:
    """Every length of one layout, shortest first, on one load; a failure ends the layout's longer lengths."""
    config = LAYOUTS[name]
    size = world_of(config)
    rows, model, failed = [], None, None
    try:
        for seq, steps in zip(args.lengths, args.steps, strict=True):
            row = Row(name, seq, size, config)
            rows.append(row)
            if failed is not None:
                row.error = failed
                continue
            began = time.perf_counter()
            try:
                if model is None:
                    model = load(directory, name, worlds.get(size), dims.vocab, args.lengths[0])
                measure_row(model, row, dims, steps)
            except Exception as exc:  # a layout that cannot run (yet) is a row with its error, not the end
                row.error = one_line(exc)
                # loading failed: so would every length; a step failed: a longer one is not tried
                failed = row.error if model is None else f"not run: the {seq}-token step failed"
                if model is not None:
                    shut_down(model)
                    model = None
            row.load_average = os.getloadavg()[0]
            if row.ok:
                print(
                    f"  {name:15s} S={seq:6d}: held {mib(row.largest('held_bytes'))} MiB, growth "
                    f"{mib(row.largest('step_growth_bytes'))} MiB, peak {mib(row.largest('step_peak_bytes'))}"
                    f" MiB, {row.tokens_per_s:7.0f} tokens/s (steps {', '.join(f'{t:.1f}' for t in row.step_seconds)}"
                    f" s; row {time.perf_counter() - began:.0f} s; load average {row.load_average:.1f})",
                    flush=True,
                )
            else:
                print(f"  {name:15s} S={seq:6d}: {failed_text(row.error)}", flush=True)
    finally:
        if model is not None:
            model.shutdown()
    return rows


def verify(directory: Path, dims: Dims, worlds: Worlds, rows: list[Row], args: argparse.Namespace) -> dict[str, Any]:
    """cp1 at its extrapolated budget length (rounded down to 1024, at most max_position_embeddings): one profiled
    step, its measured largest-rank peak beside the fit's prediction."""
    found = fit(rows, "cp1", args.budget_gib)
    if found is None or found["longest"] is None:
        return {"error": "no cp1 fit"}
    seq = min(int(found["longest"]) // 1024 * 1024, dims.max_positions)
    out: dict[str, Any] = {"seq": seq, "predicted_peak_bytes": found["a"] + found["b"] * seq}
    print(f"verify: cp1 at {seq} tokens (predicted peak {out['predicted_peak_bytes'] / MIB:.0f} MiB)", flush=True)
    model = None
    try:
        model = load(directory, "cp1", worlds.get(1), dims.vocab, args.lengths[0])
        began = time.perf_counter()
        ranks = model.run_on_ranks(rank_memory, seq, dims.vocab)
        out |= {"ranks": ranks, "seconds": time.perf_counter() - began}
        out["measured_peak_bytes"] = max(rank["step_peak_bytes"] for rank in ranks)
    except Exception as exc:
        out["error"] = one_line(exc)
    finally:
        if model is not None:
            model.shutdown()
    measured = out.get("measured_peak_bytes")
    print(f"verify: {out.get('error') or f'measured peak {measured / MIB:.0f} MiB'}", flush=True)
    return out


def run(args: argparse.Namespace, dims: Dims, report: dict[str, Any]) -> None:
    import ray

    worlds_needed = sorted({world_of(LAYOUTS[name]) for name in args.layouts})
    ray.init(
        address="local", num_cpus=max(worlds_needed), include_dashboard=False, log_to_driver=False,
        object_store_memory=512 * MIB,
    )  # fmt: skip
    ray.cloudpickle.register_pickle_by_value(bench_lora)  # its rank-side helpers travel by value to the ranks
    if __name__ != "__main__":  # imported (not run as a script): this module's rank functions travel by value too
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    order = sorted(args.layouts, key=lambda name: (world_of(LAYOUTS[name]), list(LAYOUTS).index(name)))
    worlds = Worlds(args.collective_timeout)
    rows: list[Row] = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            began = time.perf_counter()
            directory = save_model(Path(tmp), dims)
            print(f"{dims.describe()}; checkpoint written in {time.perf_counter() - began:.0f} s", flush=True)
            for name in order:
                print(f"{name} (world {world_of(LAYOUTS[name])}: {LAYOUTS[name] or 'one rank'})", flush=True)
                rows += measure_layout(name, directory, dims, worlds, args)
                report["rows"] = [asdict(row) for row in sorted(rows, key=table_order)]
                report["rank_threads"] = worlds.threads
                write(report, args)
            if args.verify:
                report["verify"] = verify(directory, dims, worlds, rows, args)
    finally:
        worlds.close()
        report["finished"] = time.strftime("%Y-%m-%d %H:%M %Z")
        report["load_average_end"] = list(os.getloadavg())
        write(report, args)
        ray.shutdown()


def table_order(row: Row) -> tuple[int, int]:
    return row.seq, list(LAYOUTS).index(row.layout)


# --- fits, targets and the report ---------------------------------------------------------------------------------


def fit(rows: list[Row], layout: str, budget_gib: float) -> dict[str, Any] | None:
    """Least squares ``peak(S) = a + b * S`` over the layout's measured largest-rank step peaks, solved for the
    budget; None with fewer than two lengths measured."""
    points = [(row.seq, row.largest("step_peak_bytes")) for row in rows if row.layout == layout and row.ok]
    if len(points) < 2:
        return None
    n = len(points)
    mean_s = sum(s for s, _ in points) / n
    mean_p = sum(p for _, p in points) / n
    b = sum((s - mean_s) * (p - mean_p) for s, p in points) / sum((s - mean_s) ** 2 for s, _ in points)
    a = mean_p - b * mean_s
    budget = budget_gib * GIB
    longest = (budget - a) / b if b > 0 and budget > a else None
    residual = max(abs(p - (a + b * s)) for s, p in points)
    return {"a": a, "b": b, "points": points, "longest": longest, "residual": residual}


def by_key(rows: list[Row]) -> dict[tuple[str, int], Row]:
    return {(row.layout, row.seq): row for row in rows}


def growth_ratio(rows: list[Row], layout: str, seq: int) -> float | None:
    table = by_key(rows)
    row, ref = table.get((layout, seq)), table.get((reference_of(layout) or "", seq))
    if row is None or ref is None or not row.ok or not ref.ok:
        return None
    return row.largest("step_growth_bytes") / ref.largest("step_growth_bytes")


def targets(rows: list[Row], args: argparse.Namespace) -> list[tuple[str, str, bool | None]]:
    """The issue's targets, each as (what, measured, met); met None where a row is missing or failed."""
    out: list[tuple[str, str, bool | None]] = []
    at = 16384 if 16384 in args.lengths else args.lengths[len(args.lengths) // 2]
    for layout, bound in (("cp2", 0.55), ("cp2 all_to_all", 0.55), ("cp4", 0.3), ("cp4 all_to_all", 0.3)):
        if layout in args.layouts:
            ratio = growth_ratio(rows, layout, at)
            got = f"{ratio:.3f}x" if ratio is not None else "no measurement"
            out.append(
                (f"step growth {layout} <= {bound}x cp1 at {at}", got, None if ratio is None else ratio <= bound)
            )
    if "tp2+sp" in args.layouts:
        for seq in args.lengths:
            ratio = growth_ratio(rows, "tp2+sp", seq)
            got = f"{ratio:.3f}x" if ratio is not None else "no measurement"
            out.append((f"step growth tp2+sp <= 0.7x tp2 at {seq}", got, None if ratio is None else ratio <= 0.7))
    base = fit(rows, "cp1", args.budget_gib)
    for layout in ("cp4", "cp4 all_to_all"):
        if layout not in args.layouts:
            continue
        mine = fit(rows, layout, args.budget_gib)
        if base is None or mine is None or base["longest"] is None or mine["longest"] is None:
            out.append((f"longest sequence in {args.budget_gib:g} GiB, {layout} >= 3.5x cp1", "no fit", None))
            continue
        ratio = mine["longest"] / base["longest"]
        out.append(
            (f"longest sequence in {args.budget_gib:g} GiB (extrapolated), {layout} >= 3.5x cp1", f"{ratio:.2f}x",
             ratio >= 3.5)
        )  # fmt: skip
    return out


def mib(value: float) -> str:
    return f"{value / MIB:,.1f}"


def markdown(report: dict[str, Any]) -> str:
    args = argparse.Namespace(**report["args"])
    dims = Dims(**report["dims"])
    names = {f.name for f in fields(Row)}
    rows = [Row(**{k: v for k, v in row.items() if k in names}) for row in report.get("rows", [])]
    table = by_key(rows)
    loads = [row.load_average for row in rows if row.load_average] or [0.0]
    threads = sorted({t for per_world in report.get("rank_threads", {}).values() for t in per_world})
    lines = [
        f"{dims.describe()}; CPU, one row (batch 1) per step, AdamW (lr 1e-4); {', '.join(args.layouts)}; one Ray "
        f"actor per rank, 1 CPU and {'/'.join(map(str, threads)) or '1'} torch thread(s) each; torch "
        f"{report['torch']}, {report['cpus']} CPUs{', ' + report['gpu'] if report.get('gpu') else ''}.",
        "",
        f"Run {report['started']} to {report.get('finished', '(unfinished)')}: `{report['command']}`. Load average "
        f"(1 / 5 / 15 min) {' / '.join(f'{x:.1f}' for x in report['load_average_start'])} at the start, "
        f"{' / '.join(f'{x:.1f}' for x in report.get('load_average_end', [])) or '-'} at the end; 1-minute "
        f"{min(loads):.1f}-{max(loads):.1f} at the rows' ends (a shared machine slows tokens/s, not the bytes).",
        "",
    ]
    for seq, steps in zip(args.lengths, args.steps, strict=True):
        lines += [
            f"### {seq} tokens ({steps} timed step{'s' if steps > 1 else ''})",
            "",
            "| layout | world | held MiB | step growth MiB | step peak MiB | growth vs cp1 (tp2+sp: vs tp2) "
            "| tokens/s |",
            "|---|---|---|---|---|---|---|",
        ]
        for layout in (name for name in LAYOUTS if name in args.layouts):
            row = table.get((layout, seq))
            if row is None:
                continue
            if not row.ok:
                lines.append(f"| {layout} | {row.world} | {failed_text(row.error)} | | | | |")
                continue
            ratio = growth_ratio(rows, layout, seq)
            versus = "" if ratio is None else f"{ratio:.3f}x" + (" (vs tp2)" if layout == "tp2+sp" else "")
            lines.append(
                f"| {layout} | {row.world} | {mib(row.largest('held_bytes'))} "
                f"| {mib(row.largest('step_growth_bytes'))} | {mib(row.largest('step_peak_bytes'))} | {versus} "
                f"| {row.tokens_per_s:,.0f} |"
            )
        lines.append("")
    budget = args.budget_gib
    lines += [
        f"### Longest sequence that trains in {budget:g} GiB per rank (extrapolated)",
        "",
        f"| layout | a (MiB) | b (KiB / token) | largest residual MiB | longest S in {budget:g} GiB | vs cp1 |",
        "|---|---|---|---|---|---|",
    ]
    base = fit(rows, "cp1", budget)
    for layout in (name for name in LAYOUTS if name in args.layouts):
        found = fit(rows, layout, budget)
        if found is None:
            lines.append(f"| {layout} | fewer than two lengths measured | | | | |")
            continue
        longest = found["longest"]
        versus = (
            f"{longest / base['longest']:.2f}x"
            if longest is not None and base is not None and base["longest"] is not None
            else ""
        )
        lines.append(
            f"| {layout} | {mib(found['a'])} | {found['b'] / 1024:,.2f} | {mib(found['residual'])} "
            f"| {f'{longest:,.0f}' if longest is not None else 'no solution'} | {versus} |"
        )
    lines += [
        "",
        f"A least-squares line peak(S) = a + b * S through each layout's measured largest-rank step peaks at "
        f"{', '.join(map(str, args.lengths))} tokens, solved for peak = {budget:g} GiB: extrapolated from the fit, "
        "not trained at that length (but see the check below).",
        "",
    ]
    check = report.get("verify")
    if check:
        if "measured_peak_bytes" in check:
            lines.append(
                f"Check: cp1 trained one step at {check['seq']:,} tokens (the extrapolated length rounded down to "
                f"1024): measured step peak {mib(check['measured_peak_bytes'])} MiB, the fit predicted "
                f"{mib(check['predicted_peak_bytes'])} MiB ({budget:g} GiB = {mib(budget * GIB)} MiB); the step took "
                f"{check['seconds']:.0f} s (profiled)."
            )
        else:
            lines.append(f"Check of the cp1 length: failed: {check.get('error')}")
    else:
        lines.append("The cp1 length was not checked by a step at that length (run with --verify).")
    lines += ["", "### Targets (issue 32)", ""]
    verdict = {True: "met", False: "NOT met", None: "not measured"}
    lines += [f"- {what}: {got} — {verdict[ok]}" for what, got, ok in targets(rows, args)]
    lines += [
        "",
        "Per rank, the largest rank's value of each column. held: the storages a rank holds when a step begins "
        "(parameters, buffers, AdamW moments); step growth: the most tensor bytes that step allocates beyond them "
        "at once (activations, gradients, all-gathered weights, the cp exchange buffers, logits and log-softmax, "
        "temporaries), from torch's profiler's allocation records; step peak = held + step growth; tensor bytes, "
        "not RSS. tokens/s: label tokens (S - 1) per second of a driver train_step, the median of the timed steps "
        "(after the profiled step at that length). Ratios compare rows of this one run. tp2+sp rows that failed "
        "mean sequence parallelism did not load or train in this checkout.",
    ]
    return "\n".join(lines) + "\n"


def write(report: dict[str, Any], args: argparse.Namespace) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = [Row(**row) for row in report.get("rows", [])]
    saved = {
        **report,
        "targets": [{"target": what, "measured": got, "met": ok} for what, got, ok in targets(rows, args)],
        "fits": {name: fit(rows, name, args.budget_gib) for name in args.layouts},
    }
    (out / "bench_long.json").write_text(json.dumps(saved, indent=1))
    (out / "bench_long.md").write_text(markdown(saved))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--lengths", nargs="+", type=int, help=f"tokens per row (default {LENGTHS})")
    parser.add_argument("--steps", nargs="+", type=int, help=f"timed steps at each length, or one for all ({STEPS})")
    parser.add_argument("--budget-gib", type=float, default=8.0, help="per-rank memory for the longest-sequence fit")
    parser.add_argument("--verify", action="store_true", help="train cp1 once at its extrapolated budget length")
    parser.add_argument("--collective-timeout", type=float, default=1800.0, help="seconds (a 32k step takes minutes)")
    parser.add_argument("--quick", action="store_true", help=f"a narrower model at {QUICK_LENGTHS}, to a temp dir")
    parser.add_argument("--out", help="default benchmarks/results (--quick: a new temporary directory)")
    parser.add_argument("--report", action="store_true", help="rewrite --out's bench_long.md from its bench_long.json")
    args = parser.parse_args()
    if args.report:
        out = args.out or "benchmarks/results"
        saved = json.loads((Path(out) / "bench_long.json").read_text())
        saved["args"]["out"] = out
        write(saved, argparse.Namespace(**saved["args"]))
        print((Path(out) / "bench_long.md").read_text())
        return
    if args.out is None:
        args.out = tempfile.mkdtemp(prefix="bench_long_quick_") if args.quick else "benchmarks/results"
    args.lengths = args.lengths or (QUICK_LENGTHS if args.quick else LENGTHS)
    args.steps = args.steps or (QUICK_STEPS if args.quick else STEPS)
    if len(args.steps) == 1:
        args.steps = args.steps * len(args.lengths)
    if len(args.steps) != len(args.lengths):
        parser.error(f"--steps: one count, or one per length ({len(args.lengths)})")
    for seq in args.lengths:
        cp = max(int(LAYOUTS[name].get("cp_size", 1)) for name in args.layouts)
        if seq % (2 * cp):
            parser.error(f"--lengths: {seq} is not a multiple of 2 x cp_size = {2 * cp}")
    args.lengths, args.steps = map(list, zip(*sorted(zip(args.lengths, args.steps, strict=True)), strict=True))
    dims = QUICK if args.quick else FULL
    if max(args.lengths) > dims.max_positions:
        parser.error(f"--lengths: at most max_position_embeddings = {dims.max_positions}")
    torch.set_num_threads(1)  # the driver only sends batches; the ranks get the cores
    executable = os.path.relpath(sys.executable) if sys.executable.startswith(os.getcwd()) else sys.executable
    report: dict[str, Any] = {
        "args": vars(args),
        "dims": asdict(dims),
        "command": shlex.join([executable, *sys.argv]),
        "started": time.strftime("%Y-%m-%d %H:%M %Z"),
        "load_average_start": list(os.getloadavg()),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "rows": [],
    }
    print(f"{dims.describe()}\nlayouts {args.layouts}, lengths {args.lengths}; writing {args.out}", flush=True)
    run(args, dims, report)
    print(markdown(report))
    print(f"written: {Path(args.out) / 'bench_long.json'}, {Path(args.out) / 'bench_long.md'}")


if __name__ == "__main__":
    main()
