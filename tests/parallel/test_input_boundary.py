"""One all-reduce of the input's gradient for the colwise projections that share an input
(raymoe.parallel.input_boundary): the real attention (q, k, v) and SwiGLU (gate, up) modules on two gloo ranks
against their unsharded twins (outputs, input and parameter gradients), with the backward's all-reduces counted;
where a consumer's style takes its input its own way, each projection keeps its own boundary, still equal."""

from __future__ import annotations

import pytest
import torch

from raymoe.models import parse_model_config
from raymoe.models.common.attention import Attention
from raymoe.models.common.mlp import FeedForward
from raymoe.parallel.styles.tensor import ColwiseParallel

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, SEQ, BATCH = 16, 4, 2, 4, 6, 2
ATTENTION_RULES = {"q_proj": "colwise", "k_proj": "colwise", "v_proj": "colwise", "o_proj": "rowwise"}
# Qwen3's per-head norms: their weights' gradients are all-reduced too, one each (not the input's).
QK_NORM_RULES = {"q_norm": "replicated_with_grad_allreduce", "k_norm": "replicated_with_grad_allreduce"}
MLP_RULES = {"gate_proj": "colwise", "up_proj": "colwise", "down_proj": "rowwise"}


class OwnBoundaryColwise(ColwiseParallel):
    """A user's colwise style with its own input hook (here: the same boundary, taken by itself)."""

    def transform_inputs_pre_forward(self, module, args, kwargs, mesh):
        return super().transform_inputs_pre_forward(module, args, kwargs, mesh)


def attention() -> Attention:
    config = parse_model_config(
        {
            "model_type": "qwen3",
            "vocab_size": 32,
            "hidden_size": HIDDEN,
            "intermediate_size": 8,
            "num_hidden_layers": 1,
            "num_attention_heads": HEADS,
            "num_key_value_heads": KV_HEADS,
            "head_dim": HEAD_DIM,
        }
    )
    return Attention(config)


def feed_forward() -> FeedForward:
    return FeedForward(HIDDEN, 8, bias=True)


BUILD = {"qkv": (attention, ATTENTION_RULES | QK_NORM_RULES), "swiglu": (feed_forward, MLP_RULES)}


def check_one_boundary(rank, module, own_style, want_backward_all_reduces):
    import torch.distributed as dist

    from raymoe.parallel.styles import builtin_styles

    build, rules = BUILD[module]
    torch.manual_seed(0)
    full = build()
    with torch.no_grad():
        for param in full.parameters():
            param.normal_(0, 0.3)
    styles = dict(builtin_styles())
    if own_style:
        styles["colwise"] = OwnBoundaryColwise()
    sharded = rank.sharded_twin(full, rules, styles)
    x = torch.randn(BATCH, SEQ, HIDDEN, generator=torch.Generator().manual_seed(1))
    extra = (torch.ones(SEQ, HEAD_DIM), torch.zeros(SEQ, HEAD_DIM)) if isinstance(full, Attention) else ()
    full_x, sharded_x = x.clone().requires_grad_(), x.clone().requires_grad_()
    want = full(full_x, *extra)
    got = sharded(sharded_x, *extra)
    rank.expect_close("output", got, want)
    probe = torch.randn(want.shape, generator=torch.Generator().manual_seed(2))
    (want * probe).sum().backward()
    with rank.dispatched_ops() as ops:
        (got * probe).sum().backward()
    dist.barrier()
    rank.expect_close_rel("input grad", sharded_x.grad, full_x.grad)
    rank.expect_same_grads(sharded, full)
    collectives = rank.collectives(ops)
    all_reduces = sum(name in ("c10d::allreduce_", "_c10d_functional::all_reduce") for name in collectives)
    assert all_reduces == want_backward_all_reduces, (collectives, want_backward_all_reduces)


@pytest.mark.parametrize(("module", "consumers", "others"), [("qkv", 3, 2), ("swiglu", 2, 0)], ids=["qkv", "swiglu"])
@pytest.mark.parametrize("own_style", [False, True], ids=["shared", "own-boundary-style"])
def test_colwise_consumers_of_one_input_all_reduce_its_gradient_once(tp2, module, consumers, others, own_style):
    tp2.run(check_one_boundary, module, own_style, (consumers if own_style else 1) + others)
