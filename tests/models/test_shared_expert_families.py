"""Qwen2-MoE, GLM-4.5 and DeepSeek-V3 beyond the shared parity tests (issue 15): block-scaled FP8 checkpoints,
the routing pieces they share, default plans against transformers' own, plans that would split an MLA head
wrongly, and the config fields only they have."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from raymoe import DistributedConfig
from raymoe.checkpoint import load_model, save_model
from raymoe.checkpoint.reader import CheckpointReader
from raymoe.models import build_model, parse_model_config
from raymoe.models.common.hub_layout import Fp8Block
from raymoe.models.moe import TopKRouter
from raymoe.spec.plans import resolve_plans

QWEN2 = "qwen2moe_e8_k3_gqa2_shared"
GLM = "glm4moe_e8_k3_shared2_qknorm"
DEEPSEEK = "deepseekv3_e8_k3_groups_qlora_yarn"
DEEPSEEK_QPROJ = "deepseekv3_e8_k2_qproj_bias"


def _ids(vocab: int, batch: int = 2, seq: int = 11, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _meta_model(make_hf_model, name):
    return build_model(parse_model_config(make_hf_model(name).config.to_dict()))


# --- block-scaled FP8 ---------------------------------------------------------------------------


def test_fp8_checkpoint_loads_the_known_weights_as_transformers_does(deepseek_fp8_checkpoint, load_hf_model):
    directory, dequantized = deepseek_fp8_checkpoint
    with safe_open(directory / "model.safetensors", "pt") as f:
        assert f.get_slice("model.layers.0.self_attn.q_b_proj.weight").get_dtype() == "F8_E4M3"
        assert "model.layers.1.mlp.experts.3.down_proj.weight_scale_inv" in set(f.keys())
    ours = load_model(directory, dtype=torch.float32)
    params = dict(ours.named_parameters())
    # the fused experts are the per-expert FP8 tensors dequantized, each with its own scales
    assert torch.equal(
        params["model.layers.0.self_attn.q_b_proj.weight"], dequantized["model.layers.0.self_attn.q_b_proj.weight"]
    )
    gate_up = params["model.layers.1.mlp.experts.gate_up_proj"]
    intermediate = gate_up.shape[1] // 2
    assert torch.equal(gate_up[3, intermediate:], dequantized["model.layers.1.mlp.experts.3.up_proj.weight"])
    assert torch.equal(
        params["model.layers.2.mlp.experts.down_proj"][5], dequantized["model.layers.2.mlp.experts.5.down_proj.weight"]
    )
    reference = load_hf_model(directory)  # transformers dequantizes on CPU
    ids = _ids(ours.config.vocab_size)
    with torch.no_grad():
        expected = reference(input_ids=ids).logits
        assert (ours(ids) - expected).abs().max().item() <= 1e-5
    assert expected.std().item() > 1e-2


def test_fp8_checkpoint_saves_plain_tensors_transformers_loads(deepseek_fp8_checkpoint, load_hf_model, tmp_path):
    directory, _ = deepseek_fp8_checkpoint
    ours = load_model(directory, dtype=torch.float32)
    save_model(ours, tmp_path)
    assert "quantization_config" not in json.loads((tmp_path / "config.json").read_text())
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        assert not any(key.endswith("_scale_inv") for key in set(f.keys()))
        assert f.get_slice("model.layers.1.mlp.experts.0.gate_proj.weight").get_dtype() == "F32"
    reloaded = load_hf_model(tmp_path)
    ids = _ids(ours.config.vocab_size)
    with torch.no_grad():
        assert (ours(ids) - reloaded(input_ids=ids).logits).abs().max().item() <= 1e-5


def test_fp8_reader_reads_any_block_through_partial_scale_blocks(tmp_path):
    """Blocks of (4, 8) that do not divide [10, 13]: the last row and column blocks are partial, as on the hub."""
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(10, 13, generator=gen) * 8).to(torch.float8_e4m3fn)
    scales = torch.rand(3, 2, generator=gen) + 0.5
    save_file({"w": weight, "w_scale_inv": scales}, tmp_path / "model.safetensors")
    expected = weight.float() * scales.repeat_interleave(4, 0)[:10].repeat_interleave(8, 1)[:, :13]
    with CheckpointReader(tmp_path, {"w": Fp8Block("w", "w_scale_inv", (4, 8))}) as reader:
        assert reader.shape("w") == (10, 13) and reader.dtype("w") == torch.float32
        assert torch.equal(reader.read("w"), expected)
        before = reader.bytes_read
        assert torch.equal(reader.read("w", (slice(5, 9), slice(7, 12))), expected[5:9, 7:12])
        # 4 x 5 fp8 bytes and the 2 x 2 float32 scales of the blocks they overlap
        assert reader.bytes_read - before == 4 * 5 + 2 * 2 * 4


def test_fp8_scales_of_the_wrong_shape_are_named(tmp_path):
    weight = torch.zeros(8, 8).to(torch.float8_e4m3fn)
    save_file({"w": weight, "w_scale_inv": torch.ones(3, 2)}, tmp_path / "model.safetensors")
    with (
        CheckpointReader(tmp_path, {"w": Fp8Block("w", "w_scale_inv", (4, 4))}) as reader,
        pytest.raises(ValueError, match=r"w_scale_inv are \(3, 2\), expected \(2, 2\)"),
    ):
        reader.check({"w": (8, 8)})


# --- routing ------------------------------------------------------------------------------------


def test_group_limited_choice_stays_in_the_best_groups():
    """Every chosen expert lies in one of the topk_group best groups, and the limit changes some choices."""
    torch.manual_seed(0)
    hidden = torch.randn(64, 16)
    limited = TopKRouter(16, 8, 3, True, selection_bias=True, scoring="sigmoid", n_group=4, topk_group=2)
    free = TopKRouter(16, 8, 3, True, selection_bias=True, scoring="sigmoid")
    for router in (limited, free):
        router.weight.data.copy_(torch.randn(8, 16, generator=torch.Generator().manual_seed(1)))
    ids, _, logits = limited(hidden)
    scores = logits.sigmoid().view(64, 4, 2)
    best_groups = scores.topk(2, dim=-1).values.sum(-1).topk(2, dim=-1).indices  # [T, 2]
    assert all(set((ids[t] // 2).tolist()) <= set(best_groups[t].tolist()) for t in range(64))
    assert not torch.equal(ids.sort(dim=-1).values, free(hidden)[0].sort(dim=-1).values)


def test_the_correction_bias_moves_the_choice_not_the_weights():
    torch.manual_seed(0)
    router = TopKRouter(16, 8, 2, False, selection_bias=True, scoring="sigmoid", scaling=2.5)
    torch.nn.init.normal_(router.weight, std=0.5)  # built with torch.empty: whatever memory held, NaN included
    hidden = torch.randn(32, 16)
    with torch.no_grad():
        router.e_score_correction_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 5.0]))
    ids, weights, logits = router(hidden)
    assert (ids == 7).any(dim=-1).all()  # the bias makes expert 7 everyone's choice
    torch.testing.assert_close(weights, 2.5 * logits.sigmoid().gather(-1, ids))  # weights: unbiased scores, scaled


# --- default plans -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", [QWEN2, GLM, DEEPSEEK])
def test_default_plans_extend_transformers_plans(name, make_hf_model):
    reference = make_hf_model(name).config
    plans = _meta_model(make_hf_model, name).default_plans()
    assert dict(plans.ep) == {f"model.{key}": style for key, style in reference.base_model_ep_plan.items()}
    for key, style in reference.base_model_tp_plan.items():
        assert plans.tp[f"model.{key}"] == style
    assert plans.tp["lm_head"] == "colwise_gather_output"


@pytest.mark.parametrize("name", [DEEPSEEK, DEEPSEEK_QPROJ])
def test_mla_tp_plan_splits_whole_heads(name, make_hf_model):
    model = _meta_model(make_hf_model, name)
    resolved = resolve_plans(model, model.default_plans(), DistributedConfig(tp_size=2, fsdp_size=1))
    query = "q_proj" if model.config.mla.q_lora_rank is None else "q_b_proj"
    assert resolved.tp_rules[f"model.layers.0.self_attn.{query}"] == "colwise"
    assert resolved.tp_rules["model.layers.0.self_attn.kv_a_proj_with_mqa"] == "mla_kv_a_proj"
    assert resolved.tp_rules["model.layers.0.self_attn.kv_b_proj"] == "colwise"


def test_a_plan_splitting_an_mla_head_fails_on_the_driver_naming_it(make_hf_model):
    model = _meta_model(make_hf_model, DEEPSEEK)  # 4 heads
    with pytest.raises(ValueError, match=r"q_b_proj"):
        resolve_plans(model, model.default_plans(), DistributedConfig(tp_size=8, fsdp_size=1))


def test_a_plan_splitting_the_compressed_kv_and_rope_key_fails_on_the_driver(make_hf_model):
    model = _meta_model(make_hf_model, DEEPSEEK)
    wrong = {**model.default_plans().tp, "model.layers.*.self_attn.kv_a_proj_with_mqa": "colwise"}
    with pytest.raises(ValueError, match=r"kv_a_proj_with_mqa"):
        resolve_plans(model, model.default_plans(), DistributedConfig(tp_size=2, fsdp_size=1, tp_plan=wrong))


# --- checkpoints of the hub -----------------------------------------------------------------------


def test_multi_token_prediction_layers_are_not_loaded(tiny_checkpoint, tmp_path):
    """Hub DeepSeek-V3 / GLM-4.5 checkpoints carry layers past num_hidden_layers (MTP); they are not the model."""
    from safetensors.torch import load_file

    original = tiny_checkpoint(DEEPSEEK_QPROJ)
    tensors = load_file(original / "model.safetensors")
    tensors["model.layers.2.eh_proj.weight"] = torch.zeros(36, 72)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((original / "config.json").read_text())
    for (name, a), (_, b) in zip(
        load_model(tmp_path).named_parameters(), load_model(original).named_parameters(), strict=True
    ):
        assert torch.equal(a, b), name


# --- config fields only these families have -------------------------------------------------------


def _config(make_hf_model, name, **changes):
    raw = make_hf_model(name).config.to_dict()
    raw.update(changes)
    return raw


def test_qwen2_moe_biases_q_k_v_but_never_o(make_hf_model):
    config = parse_model_config(_config(make_hf_model, QWEN2))
    assert config.attention_bias and config.attention_output_bias is False
    assert config.moe.shared_expert_intermediate_size == 12 and config.moe.shared_expert_gate
    no_bias = parse_model_config(_config(make_hf_model, QWEN2, qkv_bias=False))
    assert not no_bias.attention_bias


def test_glm_rotates_half_of_each_head_by_default(make_hf_model):
    config = parse_model_config(_config(make_hf_model, GLM))
    assert (config.head_dim, config.rope_dim) == (8, 4)
    raw = _config(make_hf_model, GLM)
    raw["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75}
    with pytest.raises(ValueError, match=r"partial_rotary_factor=0.75 of head_dim=4 rotates 3 channels"):
        parse_model_config({**raw, "head_dim": 4})


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"quantization_config": {"quant_method": "bitsandbytes"}}, r"quantization_config.quant_method='bitsandbytes'"),
        ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128]}}, r"weight_block_size=\[128\]"),
        ({"n_group": 3}, r"n_group=3 must divide the 8 routed experts"),
        ({"topk_group": 5}, r"topk_group=5 exceeds n_group=4"),
        ({"topk_group": 1}, r"num_experts_per_tok=3 exceeds the 2 experts of topk_group=1"),
        ({"num_key_value_heads": 2}, r"num_key_value_heads=2 must equal num_attention_heads=4"),
        ({"qk_rope_head_dim": 3}, r"qk_rope_head_dim=3 must be even"),
        ({"first_k_dense_replace": 4}, r"first_k_dense_replace=4 exceeds num_hidden_layers=3"),
        ({"q_lora_rank": 0}, r"'q_lora_rank' must be a positive integer"),
    ],
)
def test_bad_deepseek_configs_name_the_field(changes, message, make_hf_model):
    with pytest.raises(ValueError, match=message):
        parse_model_config(_config(make_hf_model, DEEPSEEK, **changes))


def test_partial_rotary_is_refused_where_the_family_has_none(make_hf_model):
    with pytest.raises(ValueError, match=r"partial_rotary_factor=0.5.*model_type='qwen2_moe'"):
        parse_model_config(_config(make_hf_model, QWEN2, partial_rotary_factor=0.5))


def test_deepseek_yarn_scales_the_softmax_by_mscale_squared(make_hf_model):
    config = parse_model_config(_config(make_hf_model, DEEPSEEK))
    mscale = 0.1 * 0.7 * torch.log(torch.tensor(4.0)).item() + 1.0
    assert config.mla.softmax_scale == pytest.approx(10**-0.5 * mscale**2)
    assert parse_model_config(_config(make_hf_model, DEEPSEEK_QPROJ)).mla.softmax_scale == pytest.approx(10**-0.5)
