"""Sequence parallelism inside TP (issue 32, CFG-9): the residual stream and the norms on a share of the sequence
over the tp group; logits, three AdamW steps, the saved checkpoint and a generation equal transformers in one
process, for Qwen3-MoE, gpt-oss and DeepSeek-V3, with FSDP, expert parallelism and context parallelism."""

import pytest

SEQ = 32
QWEN = "moe_e8_k2_mha"
GPT_OSS = "gptoss_e4_k3_gqa2_window5"
DEEPSEEK = "deepseekv3_e8_k3_groups_qlora_yarn"
ZERO_GRADIENT = {DEEPSEEK: ("self_attn.kv_a_proj_with_mqa.bias",)}

LAYOUTS = {
    "tp2-fsdp2-sp": {"tp_size": 2, "fsdp_size": 2, "enable_sequence_parallel": True},
    "tp4-sp": {"tp_size": 4, "enable_sequence_parallel": True},
    "tp2-fsdp2-ep4-sp": {"tp_size": 2, "fsdp_size": 2, "ep_size": 4, "enable_sequence_parallel": True},
    "cp2-tp2-sp": {"cp_size": 2, "tp_size": 2, "enable_sequence_parallel": True},
}


# Every family's attention between sequence shards under tp2/fsdp2; the other layouts on one family each. The tiny
# DeepSeek-V3's experts (moe_intermediate_size 6) do not split four ways.
@pytest.mark.family_layouts(
    [QWEN, GPT_OSS, DEEPSEEK], list(LAYOUTS), every_family=("tp2-fsdp2-sp",), skip=((DEEPSEEK, "tp4-sp"),)
)
def test_sequence_parallelism_trains_like_one_process(check_layout, tmp_path, name, layout):
    check_layout(LAYOUTS[layout], tmp_path, name, seq=SEQ, zero_gradient=ZERO_GRADIENT.get(name, ()))
