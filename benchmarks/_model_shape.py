"""The CPU-sized Qwen3-MoE every benchmark trains: its command-line shape flags and its checkpoint."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import transformers


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


def save_checkpoint(directory: Path, args: argparse.Namespace) -> None:
    """A random fp32 checkpoint of the shape ``args`` name, written by transformers (seed 0)."""
    config = transformers.Qwen3MoeConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        moe_intermediate_size=args.moe_intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        norm_topk_prob=True,
    )
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory)
