"""In-driver vs Ray Data tokenization + packing: conversations/s, the driver's peak RSS on generated
conversations (both engines with the same ``pack_window``), and the training steps/s each sustains at world 4.

Each engine runs in its own process (so each peak RSS is its own: ``resource.getrusage`` high-water of the driver
process; Ray's workers and object store are not counted). Both start a local Ray with ``--ray-cpus`` CPUs. The
driver engine holds every packed row in this process (``PackedData``); the Ray engine's rows stay in Ray's object
store (``StreamedData``: references and 12 bytes a row here). Conversations longer than ``--seq-len`` are
truncated (the byte-level tokenizer makes a 3-turn conversation up to ~1600 tokens). Then ``--steps`` Trainer
steps of the tiny model on 4 ranks (fsdp 4, ``--cpus-per-rank``) on that data: steps/s, and the driver's own data
work per step (picking the rows and, for the driver engine, slicing them) beside the step's time, to show whether
a step waits for data.

    .venv/bin/python benchmarks/bench_data.py [--num 100000] [--seq-len 512] [--pack-window 10000] [--steps 20]

Not run by the test suite.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORDS = [
    "the",
    "model",
    "answers",
    "each",
    "question",
    "with",
    "care",
    "and",
    "a",
    "short",
    "explanation",
    "of",
    "why",
    "result",
    "holds",
    "experts",
    "tokens",
]


def write_conversations(path: Path, num: int) -> None:
    rng = random.Random(0)
    with path.open("w") as file:
        for _ in range(num):
            messages = [{"role": "system", "content": "You are a helpful assistant."}]
            for _ in range(rng.randint(1, 3)):
                messages.append({"role": "user", "content": " ".join(rng.choices(WORDS, k=rng.randint(8, 30)))})
                messages.append({"role": "assistant", "content": " ".join(rng.choices(WORDS, k=rng.randint(20, 60)))})
            file.write(json.dumps({"messages": messages}) + "\n")


def run_one(engine: str, path: str, args: argparse.Namespace) -> None:
    import ray

    import raymoe
    from raymoe.driver.tiny import tiny_tokenizer

    ray.init(num_cpus=args.ray_cpus, log_to_driver=False)
    options = {"cache_dir": False} if engine == "driver" else {}
    began = time.perf_counter()
    data = raymoe.load_dataset(path, args.seq_len, tiny_tokenizer(), engine=engine, pack_window=args.pack_window,
                               overlong="truncate", **options)  # fmt: skip
    seconds = time.perf_counter() - began
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    result = {"engine": engine, "s": seconds, "rows": data.num_sequences, "peak_mib": peak_mib}
    if args.steps:
        result.update(train(data, args))
    print(json.dumps(result))


def train(data: object, args: argparse.Namespace) -> dict[str, float]:
    """Steps/s of the tiny model at world 4 on ``data``, and the driver's data work per step."""
    import raymoe
    from raymoe.driver.training_data import rows_of

    rows = rows_of(data)  # type: ignore[arg-type]
    batches = rows.batches(args.batch, 0, 0)
    began = time.perf_counter()
    for _ in range(args.steps):
        indices = next(batches)
        if isinstance(data, raymoe.PackedData):
            data.rows(indices)
        else:
            data.batch(indices, 4)  # type: ignore[attr-defined]
    data_ms = (time.perf_counter() - began) / args.steps * 1000
    with tempfile.TemporaryDirectory() as tmp:
        tiny = raymoe.build_tiny_checkpoint(Path(tmp) / "tiny")
        layout = raymoe.DistributedConfig(fsdp_size=4)
        with raymoe.from_pretrained(tiny, distributed_config=layout, cpus_per_rank=args.cpus_per_rank) as model:
            config = raymoe.TrainerConfig(output_dir=Path(tmp) / "run", steps=args.steps + 2,
                                          global_batch_size=args.batch, save_at_end=False, progress=False)  # fmt: skip
            trainer = raymoe.Trainer(model, data, config)  # type: ignore[arg-type]
            trainer.fit(2)  # warm-up
            began = time.perf_counter()
            trainer.fit(args.steps)
            step_s = (time.perf_counter() - began) / args.steps
    return {"steps_per_s": 1 / step_s, "step_ms": step_s * 1000, "data_ms": data_ms}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num", type=int, default=100_000, help="conversations to generate")
    parser.add_argument("--seq-len", type=int, default=512, help="tokens per row (the tiny model takes up to 512)")
    parser.add_argument("--pack-window", type=int, default=10_000)
    parser.add_argument("--ray-cpus", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20, help="training steps at world 4 (0: none)")
    parser.add_argument("--batch", type=int, default=8, help="global batch size of those steps")
    parser.add_argument("--cpus-per-rank", type=float, default=0.5)
    parser.add_argument("--engines", default="driver,ray", help="which engines to run, in order (default: both)")
    parser.add_argument("--one", nargs=2, help=argparse.SUPPRESS)  # engine, path: run one engine in this process
    args = parser.parse_args()
    if args.one:
        run_one(args.one[0], args.one[1], args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "chat.jsonl"
        write_conversations(path, args.num)
        print(f"{args.num} conversations, {path.stat().st_size / 2**20:.1f} MiB, seq_len {args.seq_len}, "
              f"pack_window {args.pack_window}, Ray CPUs {args.ray_cpus}")  # fmt: skip
        print("| engine | seconds | conversations/s | packed rows | driver peak RSS MiB | steps/s (world 4) | "
              "step ms | driver data ms/step |\n|---|---|---|---|---|---|---|---|")  # fmt: skip
        for engine in args.engines.split(","):
            command = [sys.executable, __file__, "--one", engine, str(path), "--seq-len", str(args.seq_len),
                       "--pack-window", str(args.pack_window), "--ray-cpus", str(args.ray_cpus),
                       "--steps", str(args.steps), "--batch", str(args.batch),
                       "--cpus-per-rank", str(args.cpus_per_rank)]  # fmt: skip
            out = subprocess.run(command, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
            result = json.loads(out)
            steps = (f"{result['steps_per_s']:.2f} | {result['step_ms']:.0f} | {result['data_ms']:.2f}"
                     if "steps_per_s" in result else "- | - | -")  # fmt: skip
            print(f"| {engine} | {result['s']:.1f} | {args.num / result['s']:.0f} | {result['rows']} | "
                  f"{result['peak_mib']:.0f} | {steps} |")  # fmt: skip


if __name__ == "__main__":
    main()
