"""Compiled decoder blocks (issue 33) train exactly like one process: one layout per mechanism that runs inside a block
(FSDP2's hooks, TP's redistributions, sequence parallelism, token dispatch, masked experts, context parallelism by ring
and all-to-all, pipeline stages, activation checkpointing) and the families with their own attention (gpt-oss's
sinks and windows, DeepSeek-V3's latent attention, Mixtral's grouped heads under TP with selective checkpointing);
the counts of graphs and graph breaks where a block runs something eager (token dispatch, the ring) and where it
must not (TP-sharded grouped heads and experts)."""

import pytest

MOE = "moe_e8_k2_mha"  # 8 experts, top-2, 4 heads
GPT_OSS = "gptoss_e4_k3_gqa2_window5"  # sinks, a sliding window, expert biases
MIXTRAL = "mixtral_e8_k3_gqa2_window6"  # grouped heads; under tp2 its experts take the padded grouped GEMM
DEEPSEEK = "deepseekv3_e8_k3_groups_qlora_yarn"  # multi-head latent attention, grouped routing
SEQ = 32  # context parallelism: a multiple of 2 * cp_size
MASKED = {"model.layers.*.mlp.gate": "ep_router", "model.layers.*.mlp.experts": "moe_tp_experts"}
LAYOUTS = {
    "fsdp2": {"fsdp_size": 2},
    "tp2": {"tp_size": 2},
    "tp2-sp": {"tp_size": 2, "enable_sequence_parallel": True},
    "tp2-ep2": {"tp_size": 2, "ep_size": 2},
    "tp2-fsdp2-ep2": {"tp_size": 2, "fsdp_size": 2, "ep_size": 2},
    "tp2-ep2-masked": {"tp_size": 2, "ep_size": 2, "ep_plan": MASKED},
    "fsdp2-selective": {"fsdp_size": 2, "activation_checkpointing": "selective"},
    "pp2": {"pp_size": 2, "pp_microbatches": 2},
}
# (checkpoint, layout, seq): the other families, and context parallelism. Mixtral runs check_layout's own row length
# (None): at 32, one element of its first o_proj has a gradient below AdamW's eps, whose rounding noise AdamW turns
# into a weight 5e-5 apart from transformers' even in one process (the gradients agree within 2e-7).
FAMILY_LAYOUTS = {
    "gpt-oss-cp2": (GPT_OSS, {"cp_size": 2}, SEQ),
    "gpt-oss-cp2-all_to_all": (GPT_OSS, {"cp_size": 2, "cp_mode": "all_to_all"}, SEQ),
    "deepseek-fsdp2-ep2": (DEEPSEEK, {"fsdp_size": 2, "ep_size": 2}, SEQ),
    "mixtral-tp2-selective": (MIXTRAL, {"tp_size": 2, "activation_checkpointing": "selective"}, None),
}
ZERO_GRADIENT = {DEEPSEEK: ("self_attn.kv_a_proj_with_mqa.bias",)}  # see tests/rank/conftest.py


# The backend each layout compiles with. Inductor (C++ on CPU) takes tens of seconds per graph and rank on 2 cores:
# two layouts run it on the ranks: under FSDP2's hooks, and selective checkpointing around TP-sharded blocks (torch's
# checkpoint replays the ops the forward ran, and finds inductor's compiled regions by the graph each call ran: it
# failed at the first backward while the block broke its graph and recompiled for every routing). The others run
# "aot_eager": the same graphs (dynamo's trace of the block, AOT autograd's forward and backward, the styles'
# redistributions and collectives inside them) on eager kernels, which is where a layout's own mistakes show.
# `pytest --compiled-blocks` runs every layout test on inductor.
INDUCTOR_LAYOUTS = {"fsdp2", "mixtral-tp2-selective"}
AOT_EAGER = "aot_eager"


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_compiled_layout_trains_like_one_process(check_layout, tmp_path, layout):
    check_layout(LAYOUTS[layout], tmp_path, MOE, compile=True if layout in INDUCTOR_LAYOUTS else AOT_EAGER)


@pytest.mark.parametrize("case", list(FAMILY_LAYOUTS))
def test_compiled_families_train_like_one_process(check_layout, tmp_path, case):
    name, layout, seq = FAMILY_LAYOUTS[case]
    backend = True if case in INDUCTOR_LAYOUTS else AOT_EAGER
    rows = {"seq": seq} if seq is not None else {}
    check_layout(layout, tmp_path, name, zero_gradient=ZERO_GRADIENT.get(name, ()), compile=backend, **rows)


def dynamo_counts(ctx):
    """``(whether the rank's blocks are compiled, graphs compiled, graph breaks by reason)`` in this rank's process so
    far (dynamo's counters: they add up over every test the shared world ran)."""
    from torch._dynamo.utils import counters

    from raymoe.parallel.compiled_blocks import is_compiled

    compiled = all(is_compiled(part) for part in ctx.require_model().parts) if ctx.loaded is not None else False
    return compiled, counters["stats"]["unique_graphs"], dict(counters["graph_break"])


# (checkpoint, layout, row lengths, most graph breaks and graphs a rank's first steps add): where a block runs something
# eager by design (token dispatch's split sizes are data; the ring's point-to-point exchanges), it breaks there only,
# at functions dynamo is told not to trace, and compiles the pieces between, once for every kind of layer (gpt-oss:
# sliding and full attention), and once more when the row length first changes (the length symbolic: automatic
# dynamic shapes); TP-sharded grouped heads and experts (the padded grouped GEMM, whose buffer size is data) break
# nowhere, and one graph serves both layers; sequence parallelism breaks nowhere either. Lengths split where the
# layout splits them (sequence parallelism: over tp; context parallelism: 2 cp). RL rollouts change the length every
# batch (each padded to its longest row).
# What a break's reason names where dynamo was told not to trace: torch.compiler.disable (token dispatch's experts,
# FSDP2's hooks) and the ring's attend, which torch's lazy disable marks as skipped.
EAGER_BY_DESIGN = ("disable", "RingLayout.attend")
BREAK_CASES = {
    "token-dispatch": (MOE, LAYOUTS["tp2-ep2"], (10, 12, 15, 9), 3, 4),
    "ring": (GPT_OSS, {"cp_size": 2}, (16, 20, 28, 24), 4, 5),
    "tp2-grouped-heads": (MIXTRAL, {"tp_size": 2, "activation_checkpointing": "selective"}, (10, 12, 15, 11), 0, 1),
    "tp2-sp": (MOE, LAYOUTS["tp2-sp"], (10, 12, 16, 14), 0, 2),
}


@pytest.mark.parametrize("case", list(BREAK_CASES))
def test_blocks_break_only_where_they_run_eager_code_and_compile_twice_whatever_the_lengths(
    load_on_world, tiny_checkpoint, case
):
    """Dynamo's counts on every rank: two steps at two row lengths add graph breaks only at disabled functions, and at
    most the case's breaks and graphs for each length mode; two more steps with new routings and new lengths compile
    nothing. The losses are eager's. (Forwards without gradients at changing lengths: tests/parallel.)"""
    import torch

    name, layout, widths, most_breaks, most_graphs = BREAK_CASES[case]
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 96, (8, width), generator=gen) for width in widths]

    def run(**compile):
        with load_on_world(tiny_checkpoint(name), layout, **compile) as model:
            model.configure_training(lr=1e-2)
            counts = [model.run_on_ranks(dynamo_counts)]
            out = []
            for step, ids in enumerate(batches):
                out.append(model.train_step(ids))
                if step in (1, len(batches) - 1):
                    counts.append(model.run_on_ranks(dynamo_counts))
        return out, counts

    compiled, (before, warm, after) = run(compile=AOT_EAGER)  # dynamo's counts, any backend
    for (_, graphs_before, breaks_before), (is_compiled, graphs, breaks) in zip(before, warm, strict=True):
        assert is_compiled
        new_breaks = {reason: n - breaks_before.get(reason, 0) for reason, n in breaks.items()}
        assert all(any(mark in reason for mark in EAGER_BY_DESIGN) for reason, n in new_breaks.items() if n), new_breaks
        assert sum(new_breaks.values()) <= 2 * most_breaks, new_breaks  # static and symbolic lengths
        assert graphs - graphs_before <= 2 * most_graphs
    assert after == warm  # two more steps, new routings, two new lengths: nothing compiled
    assert all("compile_s" not in metrics for metrics in compiled[2:])
    eager, _ = run(compile=False)
    for metrics, want in zip(compiled, eager, strict=True):
        assert abs(metrics["loss"] - want["loss"]) <= 1e-5 * abs(want["loss"])
