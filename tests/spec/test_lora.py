"""LoraConfig (PEFT's fields) and target resolution on the driver: every bad input is one ValueError naming it."""

import json

import pytest
import torch

from raymoe import LoraConfig
from raymoe.spec.lora import expert_names_as_parameters, resolve_lora


@pytest.fixture
def meta_model(tiny_checkpoint):
    from raymoe.models.common.config import read_config_file
    from raymoe.models.registry import build_model, parse_model_config

    def build(name: str):
        return build_model(parse_model_config(read_config_file(tiny_checkpoint(name))), device="meta")

    return build


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"use_dora": True}, "use_dora=True is not supported"),
        ({"lora_bias": True}, "lora_bias=True is not supported"),
        ({"fan_in_fan_out": True}, "fan_in_fan_out=True is not supported"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"target_modulez": ["q_proj"]}, "did you mean target_modules"),
        ({"r": 0}, "LoraConfig.r=0 must be an int >= 1"),
        ({"lora_alpha": -1}, "lora_alpha=-1"),
        ({"init_lora_weights": "pissa"}, "init_lora_weights='pissa'"),
        ({"bias": "all"}, "bias='all'"),
        ({"lora_dropout": 1.5}, "lora_dropout=1.5"),
        ({"lora_dtype": "float16"}, "lora_dtype='float16'"),
        ({"use_rslora": True, "rank_pattern": {"q_proj": 4}}, "use_rslora with rank_pattern"),
    ],
)
def test_bad_fields_are_refused(fields, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        LoraConfig(**{"target_modules": ["q_proj"], **fields})


def test_no_targets_is_refused():
    with pytest.raises(ValueError, match="needs target_modules"):
        LoraConfig()


def test_peft_defaults_are_accepted_and_round_trip():
    import peft

    written = peft.LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj"], use_rslora=True).to_dict()
    written = json.loads(json.dumps(written, default=list))
    config = LoraConfig.from_peft_dict(written)
    assert (config.r, config.lora_alpha, config.use_rslora, config.target_modules) == (4, 16, True, ("q_proj",))
    again = peft.LoraConfig(**{k: v for k, v in config.to_peft_dict("base").items() if k != "peft_type"})
    assert again.r == 4 and again.lora_alpha == 16 and set(again.target_modules) == {"q_proj"}


def test_other_peft_types_are_refused():
    with pytest.raises(ValueError, match="peft_type='IA3'"):
        LoraConfig.from_peft_dict({"peft_type": "IA3", "target_modules": ["q_proj"]})


def test_targets_resolve_with_patterns(meta_model):
    model = meta_model("moe_e8_k2_mha")
    config = LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "o_proj"],
        target_parameters=["mlp.experts.down_proj"],
        rank_pattern={r"layers\.1\.self_attn\.q_proj": 2},
        alpha_pattern={"o_proj": 2},
    )
    spec = resolve_lora(config, model)
    shapes = {target.key: (target.shape.r, target.shape.scaling) for target in spec.targets}
    assert shapes["model.layers.0.self_attn.q_proj"] == (4, 2.0)
    assert shapes["model.layers.1.self_attn.q_proj"] == (2, 4.0)
    assert shapes["model.layers.0.self_attn.o_proj"] == (4, 0.5)
    assert shapes["model.layers.1.mlp.experts.down_proj"] == (4, 2.0)
    assert len(spec.targets) == 6


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"target_modules": ["q_prj"]}, "'q_prj' matches no module of the model; the nearest names are .*q_proj"),
        ({"target_modules": ["experts"]}, "is a GroupedExperts, not an nn.Linear"),
        ({"target_parameters": ["mlp.experts.gate_up"]}, "'mlp.experts.gate_up' matches no parameter"),
        ({"target_parameters": ["self_attn.q_proj.weight"]}, "is not a fused expert weight"),
        ({"target_parameters": ["mlp.experts.down_proj"], "lora_dropout": 0.1}, "lora_dropout=0.1 with target_param"),
        ({"target_modules": "nothing.*"}, "matches no module"),
    ],
)
def test_bad_targets_are_refused(meta_model, fields, message):
    with pytest.raises(ValueError, match=message):
        resolve_lora(LoraConfig(**fields), meta_model("moe_e8_k2_mha"))


def test_transformers_4_expert_names_become_fused_parameters():
    """As PEFT reads them on transformers 5: gate + up -> gate_up_proj at twice r and alpha; down -> down_proj."""
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "gate_proj", "up_proj", "down_proj"])
    converted = expert_names_as_parameters(config, "qwen3_moe")
    assert converted.target_modules == ("q_proj",)
    assert set(converted.target_parameters) == {"gate_up_proj", "down_proj"}
    assert converted.rank_pattern == {r".*\.gate_up_proj": 8} and converted.alpha_pattern == {r".*\.gate_up_proj": 16}
    assert expert_names_as_parameters(config, "gpt_oss") == config
    with pytest.raises(ValueError, match="names \\['w1'\\] but not \\['w3'\\]"):
        expert_names_as_parameters(LoraConfig(target_modules=["w1"]), "mixtral")


def test_adapter_directory_is_checked(tmp_path, meta_model):
    with pytest.raises(ValueError, match="is not a directory"):
        resolve_lora(str(tmp_path / "absent"), meta_model("moe_e8_k2_mha"))
    (tmp_path / "adapter_config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"adapter_model\.safetensors is missing"):
        resolve_lora(str(tmp_path), meta_model("moe_e8_k2_mha"))
    with pytest.raises(ValueError, match="no URLs"):
        resolve_lora("s3://bucket/adapter", meta_model("moe_e8_k2_mha"))


def test_expert_adapter_computes_the_low_rank_update_without_delta_w(meta_model):
    """Experts with an adapter equal experts whose weight is W + s B A, and allocate nothing of [E, out, in]."""
    from raymoe.models.common.lora import AdapterShape, add_expert_adapter, merged
    from raymoe.models.moe.experts import GroupedExperts

    torch.manual_seed(0)
    experts = GroupedExperts(8, 64, 32)
    experts.reset_parameters(0.1)
    add_expert_adapter(experts, "gate_up_proj", AdapterShape(r=4, scaling=2.0))
    with torch.no_grad():
        experts.gate_up_proj_lora_A.normal_(0, 0.1)
        experts.gate_up_proj_lora_B.normal_(0, 0.1)
    x, ids, weights = torch.randn(12, 64), torch.randint(0, 8, (12, 2)), torch.rand(12, 2)
    plain = GroupedExperts(8, 64, 32)
    with torch.no_grad():
        plain.gate_up_proj.copy_(
            merged(experts.gate_up_proj, experts.gate_up_proj_lora_A, experts.gate_up_proj_lora_B, 2.0)
        )
        plain.down_proj.copy_(experts.down_proj)
    assert (experts(x, ids, weights) - plain(x, ids, weights)).abs().max().item() <= 1e-5
    delta_bytes = experts.gate_up_proj.numel() * 4
    largest = []

    def record(tensor):
        largest.append(tensor.numel() * tensor.element_size())

    from torch.utils._python_dispatch import TorchDispatchMode

    class Allocations(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.is_view:  # a view (the weight read transposed) allocates nothing
                return out
            for tensor in out if isinstance(out, tuple | list) else [out]:
                if isinstance(tensor, torch.Tensor):
                    record(tensor)
            return out

    for base in (experts.gate_up_proj, experts.down_proj):
        base.requires_grad_(False)  # a frozen base: only the factors get gradients
    with Allocations():
        experts(x, ids, weights).sum().backward()
    grads = {experts.gate_up_proj_lora_A.numel() * 4, experts.gate_up_proj_lora_B.numel() * 4}
    assert max(size for size in largest if size not in grads) < delta_bytes
