"""What document-masked packing costs a training step against plain packing (issue 20).

Plain packing runs attention over the whole row (SDPA's ``is_causal`` kernel); document packing regroups each
row's documents into padded batches of similar length and runs the same causal attention on each
(:mod:`raymoe.models.common.packing`; positions restart at each document), so it skips the scores between
documents (an SDPA boolean block mask was measured first and was slower). This script times one rank's forward
+ backward of the same rows both ways, in this process (on 2 cores a distributed step's Ray and gloo noise is
larger than the difference), at several shapes: every row of the table is reported.

    model     the embedded demo model (``--model tiny``: hidden 96, 2 layers, 8 experts) or a wider dense-attention
              Qwen3-MoE (``--model wide``: hidden 512, 4 layers, 8 heads of 64) where attention is a larger share
    rows      ``--shapes B:S`` (default 8:256 4:1024 2:2048), documents of random lengths averaging ``--doc-len``
    figures   tokens/s of the best of ``--rounds`` medians of ``--steps`` steps, and document / plain

``--distributed`` also times ``train_step`` on the demo layout (tp2/fsdp2/ep2, 4 CPU ranks) for the first shape.

    .venv/bin/python benchmarks/bench_packing.py [--model tiny] [--shapes 8:256 4:1024] [--doc-len 200]

Not run by the test suite.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

import raymoe
from raymoe.checkpoint import load_model, save_model
from raymoe.driver.tiny import TINY_MOE_CONFIG
from raymoe.models.common.loss import causal_lm_loss
from raymoe.models.registry import build_model, parse_model_config

WIDE = {
    **TINY_MOE_CONFIG,
    "hidden_size": 512,
    "intermediate_size": 1024,
    "moe_intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "max_position_embeddings": 4096,
}


def packed_rows(batch: int, seq: int, doc_len: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, S]`` ids and document ids: documents of lengths uniform in [1, 2 doc_len] back to back."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (batch, seq), generator=gen)
    documents = torch.empty_like(ids)
    for row in range(batch):
        start, doc = 0, 0
        while start < seq:
            length = int(torch.randint(1, 2 * doc_len + 1, (1,), generator=gen))
            documents[row, start : start + length] = doc
            start, doc = start + length, doc + 1
    return ids, documents


def step_s(model: torch.nn.Module, ids: torch.Tensor, documents: torch.Tensor | None, steps: int) -> float:
    times = []
    for _ in range(steps + 1):  # the first is warmup
        began = time.perf_counter()
        loss = causal_lm_loss(model(ids, document_ids_BS=documents), ids)
        loss.backward()
        model.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - began)
    return statistics.median(times[1:])


def distributed_tokens_per_s(checkpoint: Path, ids: torch.Tensor, documents: torch.Tensor, steps: int) -> dict:
    layout = {"tp_size": 2, "fsdp_size": 2, "ep_size": 2}
    out = {}
    with raymoe.from_pretrained(checkpoint, distributed_config=layout) as model:
        model.configure_training(lr=1e-4)
        for name, docs in (("plain", None), ("document", documents)):
            times = []
            for _ in range(steps + 1):
                began = time.perf_counter()
                model.train_step(ids, document_ids=docs)
                times.append(time.perf_counter() - began)
            out[name] = ids.numel() / statistics.median(times[1:])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("tiny", "wide"), default="tiny")
    parser.add_argument("--shapes", nargs="+", default=["8:256", "4:1024", "2:2048"])
    parser.add_argument("--doc-len", type=int, default=200, help="mean document length in tokens")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--distributed", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    config = {**(WIDE if args.model == "wide" else TINY_MOE_CONFIG), "max_position_embeddings": 4096}
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = Path(tmp) / "model"
        model_config = parse_model_config(config)
        save_model(build_model(model_config, device="cpu"), checkpoint)
        raymoe.TextTokenizer.byte_level().save(checkpoint)
        model = load_model(checkpoint).train()
        print(f"model {args.model}: hidden {config['hidden_size']}, {config['num_hidden_layers']} layers, "
              f"torch {torch.__version__}, {torch.get_num_threads()} threads")  # fmt: skip
        print(f"{'B x S':>10} {'docs/row':>9} {'plain tok/s':>12} {'document tok/s':>15} {'document/plain':>15}")
        first = None
        for shape in args.shapes:
            batch, seq = (int(v) for v in shape.split(":"))
            ids, documents = packed_rows(batch, seq, args.doc_len)
            first = first or (ids, documents)
            best = {"plain": float("inf"), "document": float("inf")}
            for _ in range(args.rounds):  # alternate, so neither always runs first
                best["plain"] = min(best["plain"], step_s(model, ids, None, args.steps))
                best["document"] = min(best["document"], step_s(model, ids, documents, args.steps))
            docs_per_row = (documents.max(dim=1).values + 1).float().mean().item()
            plain, document = ids.numel() / best["plain"], ids.numel() / best["document"]
            print(
                f"{batch:>4} x {seq:<5}{docs_per_row:>9.1f} {plain:>12.0f} {document:>15.0f} {document / plain:>15.2f}"
            )
        if args.distributed and first is not None:
            rates = distributed_tokens_per_s(checkpoint, *first, args.steps)
            print(f"tp2/fsdp2/ep2 train_step, first shape: plain {rates['plain']:.0f} tok/s, "
                  f"document {rates['document']:.0f} tok/s ({rates['document'] / rates['plain']:.2f})")  # fmt: skip


if __name__ == "__main__":
    main()
