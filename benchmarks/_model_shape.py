"""The CPU-sized Qwen3-MoE checkpoints the benchmarks train: command-line shape flags, named shapes, the checkpoint.

Named shapes (``SHAPES``) span what MoE models look like, scaled to a 2-core CPU:

    few-large    8 experts top-2, wide experts (moe_intermediate 512): Mixtral-like
    many-small   64 experts top-8, narrow experts (moe_intermediate 64): DeepSeek / Qwen3-30B-A3B-like
    dense-heavy  half the layers dense with a wide MLP (intermediate 2048), 8 experts top-2 on the rest

These three attend with 4 heads, each with its own keys and values (``MATRIX_SHAPES``, the matrix's default). Real
MoE models group their query heads on fewer key/value heads (Qwen3-30B-A3B: 32 on 4, Mixtral 32 on 8, gpt-oss 64 on 8);
``few-large-gqa`` and ``many-small-gqa`` are the first two with 8 query heads on 2 kv heads (head_dim 32), which a
benchmark runs when named (``--shapes many-small-gqa``).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers


@dataclass(frozen=True)
class Shape:
    """One model and batch shape (the fields ``add_shape_args`` names)."""

    batch: int = 4
    seq: int = 256
    vocab: int = 4096
    hidden: int = 256
    layers: int = 4
    heads: int = 4
    kv_heads: int = 4
    experts: int = 16
    top_k: int = 4
    moe_intermediate: int = 128
    intermediate: int | None = None  # dense MLP width (default 4 * hidden)
    dense_layers: tuple[int, ...] = field(default=())  # layers with a dense MLP instead of experts

    def describe(self) -> str:
        dense = (
            f", dense layers {list(self.dense_layers)} (intermediate {self.dense_width})" if self.dense_layers else ""
        )
        return (
            f"hidden {self.hidden}, {self.layers} layers, {self.experts} experts top-{self.top_k} "
            f"(moe_intermediate {self.moe_intermediate}){dense}, vocab {self.vocab}, batch {self.batch}x{self.seq}"
        )

    @property
    def dense_width(self) -> int:
        return self.intermediate or 4 * self.hidden


SHAPES = {
    "few-large": Shape(experts=8, top_k=2, moe_intermediate=512),
    "many-small": Shape(experts=64, top_k=8, moe_intermediate=64),
    "dense-heavy": Shape(experts=8, top_k=2, moe_intermediate=128, intermediate=2048, dense_layers=(0, 2)),
    "few-large-gqa": Shape(experts=8, top_k=2, moe_intermediate=512, heads=8, kv_heads=2),
    "many-small-gqa": Shape(experts=64, top_k=8, moe_intermediate=64, heads=8, kv_heads=2),
}
MATRIX_SHAPES = ("few-large", "many-small", "dense-heavy")


def add_shape_args(parser: argparse.ArgumentParser, *, heads: int, kv_heads: int) -> None:
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=heads)
    parser.add_argument("--kv-heads", type=int, default=kv_heads)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--moe-intermediate", type=int, default=128)


def shape_args(name: str) -> Shape:
    """The named shape ``name`` (one of ``SHAPES``)."""
    return SHAPES[name]


def save_checkpoint(directory: Path, args: argparse.Namespace | Shape) -> None:
    """A random fp32 checkpoint of the shape ``args`` name, written by transformers (seed 0)."""
    intermediate = getattr(args, "intermediate", None) or 4 * args.hidden
    config = transformers.Qwen3MoeConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=intermediate,
        moe_intermediate_size=args.moe_intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        norm_topk_prob=True,
        mlp_only_layers=list(getattr(args, "dense_layers", ())),
    )
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory)
