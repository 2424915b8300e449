"""Context parallelism trains like one process (issue 32): every sequence split over cp ranks, alone and with FSDP,
TP, expert parallelism (token dispatch and masking), HSDP and pipelines; logits, three AdamW steps, the saved
checkpoint and a generation equal transformers in one process, for Qwen3-MoE, gpt-oss (sliding windows and sinks)
and DeepSeek-V3 (MLA)."""

import pytest

SEQ = 32  # a multiple of 2 * cp_size for cp 2 and 4 (no weight of the tiny models gets a near-zero gradient)
QWEN = "moe_e8_k2_mha"  # 4 heads, 8 experts
GPT_OSS = "gptoss_e4_k3_gqa2_window5"  # 8 heads / 4 kv heads, window 5, sinks, 4 experts
DEEPSEEK = "deepseekv3_e8_k3_groups_qlora_yarn"  # MLA, 4 heads, 8 experts, YaRN


def masked(router: str) -> dict[str, str]:
    """The masked expert-parallel plan (ep_size == tp_size) of a family whose router is ``mlp.<router>``."""
    return {f"model.layers.*.mlp.{router}": "ep_router", "model.layers.*.mlp.experts": "moe_tp_experts"}


ROUTER = {QWEN: "gate", GPT_OSS: "router", DEEPSEEK: "gate"}

LAYOUTS = {
    "cp2": {"cp_size": 2},
    "cp4": {"cp_size": 4},
    "cp2-fsdp2": {"cp_size": 2, "fsdp_size": 2},
    "cp2-tp2": {"cp_size": 2, "tp_size": 2},
    "cp2-fsdp2-ep4": {"cp_size": 2, "fsdp_size": 2, "ep_size": 4},
    "cp2-tp2-ep2-masked": {"cp_size": 2, "tp_size": 2, "ep_size": 2, "masked": True},
    "cp2-pp2": {"cp_size": 2, "pp_size": 2, "pp_microbatches": 2},
    "dp_replicate2-cp2": {"dp_replicate_size": 2, "cp_size": 2},  # HSDP: shards over cp, replicas across
}


# a key bias under softmax attention without sinks has an exact gradient of zero (tests/rank/conftest.py)
ZERO_GRADIENT = {DEEPSEEK: ("self_attn.kv_a_proj_with_mqa.bias",)}


# Each attention (MHA, GQA with windows and sinks, MLA) under ring attention at both cp sizes (cp4: gpt-oss's window
# of 5 spans two of its chunks of 4) and with heads split by tp; each other layout on one family in turn.
@pytest.mark.family_layouts([QWEN, GPT_OSS, DEEPSEEK], list(LAYOUTS), every_family=("cp2", "cp4", "cp2-tp2"))
def test_every_family_trains_like_one_process_under_context_parallelism(check_layout, tmp_path, name, layout):
    check_layout(config_of(layout, name), tmp_path, name, seq=SEQ, zero_gradient=ZERO_GRADIENT.get(name, ()))


# all-to-all splits each family's heads four ways under cp4; the other two layouts on one family each
@pytest.mark.family_layouts([QWEN, GPT_OSS, DEEPSEEK], ["cp2-fsdp2", "cp4", "cp2-tp2"], every_family=("cp4",))
def test_all_to_all_attention_trains_like_one_process(check_layout, tmp_path, name, layout):
    config = {**config_of(layout, name), "cp_mode": "all_to_all"}
    check_layout(config, tmp_path, name, seq=SEQ, zero_gradient=ZERO_GRADIENT.get(name, ()))


def config_of(layout: str, name: str) -> dict:
    config = dict(LAYOUTS[layout])
    if config.pop("masked", False):
        config["ep_plan"] = masked(ROUTER[name])
    return config


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_recomputes_attention_across_the_split(check_layout, tmp_path, mode):
    """The recomputed forward of each layer passes keys and values around the ring again, on every cp rank."""
    check_layout({"cp_size": 2, "fsdp_size": 2, "activation_checkpointing": mode}, tmp_path, GPT_OSS, seq=SEQ)
