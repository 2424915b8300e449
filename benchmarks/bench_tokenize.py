"""Tokenization throughput and the cache (issue 20): rows/s of ``raymoe.load_dataset`` on chat and text JSONL,
the first run (render + tokenize + pack) against the second (the cache by content hash, then packing).

The data is generated here (``--rows`` conversations of 1-3 turns, about 100 words each; the same amount as
text documents). Tokenizers:

    byte      the embedded model's byte-level tokenizer and ChatML template
    qwen3     Qwen3's real chat template (tests/fixtures/chat_templates) with a byte-level BPE of 8k merges
              trained here on the data, Qwen's pre-tokenizer split (as a Qwen3 tokenizer.json has it)

Each row of the table is one (tokenizer, kind, num_proc): rows, tokens, the first run's seconds and rows/s,
the cached run's seconds and rows/s. ``num_proc`` 1 tokenizes in this process; more start that many worker
processes (spawn: each imports raymoe and torch, a few seconds on 2 cores, so they pay off only on large data).
``--transformers`` adds the reference: transformers' ``apply_chat_template(..., tokenize=True)`` over the same
conversations with the qwen3 tokenizer (one render per conversation, no labels, no packing).

    .venv/bin/python benchmarks/bench_tokenize.py [--rows 20000] [--num-proc 1 2] [--seq-len 2048] [--transformers]

Not run by the test suite.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

import raymoe
from raymoe.driver.chat import ChatTemplate
from raymoe.driver.tiny import tiny_tokenizer

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "chat_templates"
QWEN_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
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
    "the",
    "result",
    "holds",
    "while",
    "the",
    "user",
    "asks",
    "for",
    "more",
    "detail",
    "about",
    "experts",
    "routers",
    "tokens",
    "layers",
    "gradients",
    "batches",
]


def sentence(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)).capitalize() + "."


def write_data(directory: Path, rows: int) -> tuple[Path, Path]:
    rng = random.Random(0)
    chat, text = directory / "chat.jsonl", directory / "text.jsonl"
    with chat.open("w") as chat_file, text.open("w") as text_file:
        for _ in range(rows):
            messages = [{"role": "system", "content": "You are a helpful assistant."}]
            for _ in range(rng.randint(1, 3)):
                messages.append({"role": "user", "content": sentence(rng, rng.randint(8, 30))})
                messages.append({"role": "assistant", "content": sentence(rng, rng.randint(20, 60))})
            chat_file.write(json.dumps({"messages": messages}) + "\n")
            text_file.write(json.dumps({"text": " ".join(m["content"] for m in messages)}) + "\n")
    return chat, text


def qwen3_tokenizer(corpus: Path) -> raymoe.TextTokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=8192, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tokenizer.train([str(corpus)], trainer)
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")])
    tokenizer.add_tokens([AddedToken(t, special=False) for t in ("<think>", "</think>")])
    template = ChatTemplate((FIXTURES / "qwen3.jinja").read_text(), {"eos_token": "<|im_end|>"}, "qwen3")
    return raymoe.TextTokenizer(tokenizer, chat_template=template)


def transformers_rows_per_s(tokenizer: raymoe.TextTokenizer, chat: Path) -> float:
    import transformers

    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save(tmp)
        reference = transformers.AutoTokenizer.from_pretrained(tmp)
        conversations = [json.loads(line)["messages"] for line in chat.read_text().splitlines()]
        began = time.perf_counter()
        for start in range(0, len(conversations), 1000):
            reference.apply_chat_template(conversations[start : start + 1000], tokenize=True, return_dict=False)
        return len(conversations) / (time.perf_counter() - began)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=20000)
    parser.add_argument("--num-proc", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--transformers", action="store_true", help="also time transformers' apply_chat_template")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        chat, text = write_data(root, args.rows)
        tokenizers = {"byte": tiny_tokenizer(), "qwen3": qwen3_tokenizer(text)}
        print(f"{args.rows} rows; chat.jsonl {chat.stat().st_size / 2**20:.1f} MiB, text.jsonl "
              f"{text.stat().st_size / 2**20:.1f} MiB")  # fmt: skip
        header = f"{'tokenizer':>9} {'kind':>5} {'procs':>5} {'tokens':>10} {'first s':>8} {'rows/s':>8}"
        print(f"{header} {'cached s':>9} {'rows/s':>9}")
        for name, tokenizer in tokenizers.items():
            for kind, path in (("chat", chat), ("text", text)):
                for procs in args.num_proc:
                    cache = root / f"cache-{name}-{kind}-{procs}"
                    times, data = [], None
                    for _ in range(2):
                        began = time.perf_counter()
                        data = raymoe.load_dataset(path, args.seq_len, tokenizer, cache_dir=cache, num_proc=procs)
                        times.append(time.perf_counter() - began)
                    assert data is not None and data.report is not None and data.report.from_cache
                    print(
                        f"{name:>9} {kind:>5} {procs:>5} {data.report.tokens:>10} {times[0]:>8.2f} "
                        f"{args.rows / times[0]:>8.0f} {times[1]:>9.2f} {args.rows / times[1]:>9.0f}"
                    )
        if args.transformers:
            rate = transformers_rows_per_s(tokenizers["qwen3"], chat)
            print(f"transformers apply_chat_template, qwen3: {rate:.0f} rows/s")


if __name__ == "__main__":
    main()
