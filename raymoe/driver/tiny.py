"""The embedded tiny model: a random Qwen3-MoE checkpoint built locally, for demos and tests without a network.

Built with raymoe's own model code and written in the hub layout (``config.json``,
``model.safetensors``, ``tokenizer.json``), so ``raymoe.from_pretrained`` loads it like any hub
checkpoint. Its tokenizer is byte-level (:meth:`raymoe.driver.tokenizer.TextTokenizer.byte_level`): ids
0-255 are UTF-8 bytes, 256 is ``<|endoftext|>``, 257 ``<|pad|>``, 258 / 259 the chat turn markers
``<|im_start|>`` / ``<|im_end|>``; the vocabulary is padded to 264 so that every tp_size up to 8 splits
it evenly. Its ``tokenizer_config.json`` carries a ChatML chat template (:data:`TINY_CHAT_TEMPLATE`)::

    <|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n

so assistant-only loss trains on ``4<|im_end|>``: each answer's bytes and its end marker.

Sizes are chosen so that every layout of up to 8 ranks fits: 4 attention (and kv) heads,
8 experts (ep_size 2, 4 or 8), and dimensions divisible by 8.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from raymoe.checkpoint.model_io import save_model
from raymoe.driver.chat import ChatTemplate
from raymoe.driver.tokenizer import END_OF_TEXT, PAD, TextTokenizer
from raymoe.models.registry import build_model, parse_model_config

TINY_MOE_CONFIG: dict[str, Any] = {
    "model_type": "qwen3_moe",
    "architectures": ["Qwen3MoeForCausalLM"],
    "vocab_size": 264,
    "hidden_size": 96,
    "intermediate_size": 192,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 24,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    # Trained with a load-balancing loss (SPEC LB-2): without one its routers collapse onto two experts.
    "output_router_logits": True,
    "router_aux_loss_coef": 0.04,
    "max_position_embeddings": 512,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "bos_token_id": 256,
    "eos_token_id": 256,
    "pad_token_id": 257,
    "initializer_range": 0.02,
    "dtype": "float32",
}


# ChatML, as Qwen's templates write it (without their tool and reasoning parts).
TINY_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def tiny_tokenizer() -> TextTokenizer:
    """The embedded model's tokenizer: byte-level, with the ChatML template."""
    template = ChatTemplate(TINY_CHAT_TEMPLATE, {"eos_token": END_OF_TEXT, "pad_token": PAD}, "the embedded model")
    return TextTokenizer.byte_level(chat_template=template)


def build_tiny_checkpoint(directory: str | os.PathLike[str], *, seed: int = 0) -> Path:
    """Write the tiny random Qwen3-MoE (weights from ``seed``) and its byte-level tokenizer (``tokenizer.json``,
    ``tokenizer_config.json`` with the chat template) into ``directory``."""
    path = Path(directory).expanduser().absolute()
    path.mkdir(parents=True, exist_ok=True)
    # A private RNG stream: building the model must not move the caller's global torch seed.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = build_model(parse_model_config(TINY_MOE_CONFIG), device="cpu")
    save_model(model, path)
    tiny_tokenizer().save(path)
    return path
