"""Every layout trains exactly like one process (issue 6): three AdamW steps on a tiny Qwen3-MoE give the
losses and, gathered, the weights of transformers in one process; the saved checkpoint loads in transformers
and gives the handle's logits."""

import pytest
import torch

MOE = "moe_e8_k2_mha"  # 8 experts, top-2, 4 heads and 4 kv heads: splits 4 ways on every axis
MASKED = {"model.layers.*.mlp.gate": "ep_router", "model.layers.*.mlp.experts": "moe_tp_experts"}

pytestmark = pytest.mark.world_of_8  # one block with the world of 8 ranks' other users (tests/conftest.py)

LAYOUTS = {
    # issue 6's acceptance list
    "tp2-fsdp2-ep2": {"tp_size": 2, "fsdp_size": 2, "ep_size": 2},
    "fsdp4-ep4": {"fsdp_size": 4, "ep_size": 4},
    "fsdp4-ep2": {"fsdp_size": 4, "ep_size": 2},  # efsdp 2
    "tp2-fsdp2-ep4": {"tp_size": 2, "fsdp_size": 2, "ep_size": 4},
    "tp4-ep4": {"tp_size": 4, "ep_size": 4},
    "tp4-ep4-masked": {"tp_size": 4, "ep_size": 4, "ep_plan": MASKED},
    "dp_replicate2-fsdp2-ep2": {"dp_replicate_size": 2, "fsdp_size": 2, "ep_size": 2},
    "tp2-fsdp2": {"tp_size": 2, "fsdp_size": 2},
    "tp4-fsdp2-ep4": {"tp_size": 4, "fsdp_size": 2, "ep_size": 4},
    "fsdp8-ep4": {"fsdp_size": 8, "ep_size": 4},
    "tp2-fsdp4-ep4": {"tp_size": 2, "fsdp_size": 4, "ep_size": 4},
    # more data-parallel shapes
    "fsdp4": {"fsdp_size": 4},
    "dp_replicate2-fsdp2": {"dp_replicate_size": 2, "fsdp_size": 2},
    "dp_replicate2-tp2": {"dp_replicate_size": 2, "tp_size": 2},
    "fsdp2-ep2-plan-override": {"fsdp_size": 2, "ep_size": 2, "fsdp_plan": {"model.layers.*": "keep_full_weight"}},
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_trains_like_one_process(check_layout, tmp_path, layout):
    metrics = check_layout(LAYOUTS[layout], tmp_path, MOE)
    assert all(m["num_tokens"] > 0 and m["grad_norm"] > 0 for m in metrics)


@pytest.mark.parametrize("layout", ["tp2-fsdp2", "tp2-fsdp2-ep2"])  # token dispatch: split sizes per micro-batch
def test_gradient_accumulation_equals_one_big_step(check_layout, tmp_path, layout):
    check_layout(LAYOUTS[layout], tmp_path, MOE, micro_batches=2)


def starved_checkpoint(directory):
    """Top-1 routing where experts 2 and 3 (the second ep rank's block under ep=2) never win: their router rows
    are the mean of experts 0 and 1, so their logit never exceeds the larger of those two."""
    import transformers

    config = transformers.Qwen3MoeConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
        num_experts=4,
        num_experts_per_tok=1,
        norm_topk_prob=False,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            router = layer.mlp.gate.weight
            router[2:] = router[:2].mean(dim=0)
    model.save_pretrained(directory)
    return directory


@pytest.mark.parametrize("config", [{"fsdp_size": 2, "ep_size": 2}, {"tp_size": 2, "fsdp_size": 2, "ep_size": 4}])
def test_a_rank_whose_experts_get_no_tokens_trains_without_hang(check_layout, tmp_path, config):
    checkpoint = starved_checkpoint(tmp_path / "starved")
    metrics = check_layout(config, tmp_path / "out", checkpoint)
    # the first step routes as crafted (later steps move the router rows apart)
    first = metrics[0]
    assert all(layer[2] == layer[3] == 0 for layer in first["expert_load"])
    starved_ranks = [r for r in range(len(first["rank_load"][0])) if r % config["ep_size"] >= config["ep_size"] // 2]
    assert starved_ranks and all(layer[r] == 0 for layer in first["rank_load"] for r in starved_ranks)


@pytest.mark.parametrize("layout", ["fsdp4", "dp_replicate2-fsdp2"])
@pytest.mark.parametrize("name", ["moe_e6_k1_gqa3_tied_step2", "qwen3_gqa4_tied"])
def test_a_tied_head_trains_like_one_process_under_fsdp(check_layout, tmp_path, layout, name):
    """The head's weight is the embedding's: one FSDP unit (the root) holds it, not the head's unit and the root."""
    check_layout(LAYOUTS[layout], tmp_path, name)
