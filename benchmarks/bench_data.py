"""In-driver vs Ray Data tokenization + packing (issue 35): rows/s and the driver's peak RSS on generated
conversations, both engines with the same ``pack_window``.

Each engine runs in its own process (so each peak RSS is its own: ``resource.getrusage`` high-water of the driver
process; Ray's workers are not counted). The Ray engine starts a local Ray with ``--ray-cpus`` CPUs.

    .venv/bin/python benchmarks/bench_data.py [--num 100000] [--seq-len 2048] [--pack-window 10000]

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


def run_one(engine: str, path: str, seq_len: int, window: int, cpus: int) -> None:
    import raymoe
    from raymoe.driver.tiny import tiny_tokenizer

    if engine == "ray":
        import ray

        ray.init(num_cpus=cpus, log_to_driver=False)
    options = {"cache_dir": False} if engine == "driver" else {}
    began = time.perf_counter()
    data = raymoe.load_dataset(path, seq_len, tiny_tokenizer(), engine=engine, pack_window=window, **options)
    seconds = time.perf_counter() - began
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"engine": engine, "s": seconds, "rows": data.num_sequences, "peak_mib": peak_mib}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num", type=int, default=100_000, help="conversations to generate")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--pack-window", type=int, default=10_000)
    parser.add_argument("--ray-cpus", type=int, default=2)
    parser.add_argument("--one", nargs=2, help=argparse.SUPPRESS)  # engine, path: run one engine in this process
    args = parser.parse_args()
    if args.one:
        run_one(args.one[0], args.one[1], args.seq_len, args.pack_window, args.ray_cpus)
        return
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "chat.jsonl"
        write_conversations(path, args.num)
        print(f"{args.num} conversations, {path.stat().st_size / 2**20:.1f} MiB, seq_len {args.seq_len}, "
              f"pack_window {args.pack_window}, Ray CPUs {args.ray_cpus}")  # fmt: skip
        print("| engine | seconds | conversations/s | packed rows | driver peak RSS MiB |\n|---|---|---|---|---|")
        for engine in ("driver", "ray"):
            command = [sys.executable, __file__, "--one", engine, str(path), "--seq-len", str(args.seq_len),
                       "--pack-window", str(args.pack_window), "--ray-cpus", str(args.ray_cpus)]  # fmt: skip
            out = subprocess.run(command, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
            result = json.loads(out)
            print(f"| {engine} | {result['s']:.1f} | {args.num / result['s']:.0f} | {result['rows']} | "
                  f"{result['peak_mib']:.0f} |")  # fmt: skip


if __name__ == "__main__":
    main()
