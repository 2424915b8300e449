"""Plan resolution (PLAN-1…PLAN-6) on a toy MoE model with Hugging Face module names, built on meta."""

import logging

import pytest
import torch
from torch import nn

from raymoe import DistributedConfig, ParallelStyle
from raymoe.parallel.styles import ExpertRole, StyleRegistry
from raymoe.spec.plans import DefaultPlans, resolve_plans

H, INTER, E, LAYERS, VOCAB = 8, 4, 4, 2, 16


class Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * INTER, H))
        self.down_proj = nn.Parameter(torch.empty(E, H, INTER))


class Moe(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(H, E, bias=False)
        self.experts = Experts()


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(H, H, bias=False) for _ in range(4))
        self.q_norm, self.k_norm = nn.RMSNorm(H), nn.RMSNorm(H)


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn = Attention()
        self.mlp = Moe()
        self.input_layernorm = nn.RMSNorm(H)
        self.post_attention_layernorm = nn.RMSNorm(H)


class Base(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, H)
        self.layers = nn.ModuleList(Layer() for _ in range(LAYERS))
        self.norm = nn.RMSNorm(H)


class CausalLM(nn.Module):
    base_model_prefix = "model"

    def __init__(self):
        super().__init__()
        self.model = Base()
        self.lm_head = nn.Linear(H, VOCAB, bias=False)


TP = {
    "model.embed_tokens": "embedding_rowwise",
    "model.layers.*.self_attn.q_proj": "colwise",
    "model.layers.*.self_attn.k_proj": "colwise",
    "model.layers.*.self_attn.v_proj": "colwise",
    "model.layers.*.self_attn.o_proj": "rowwise",
    "model.layers.*.self_attn.q_norm": "replicated_with_grad_allreduce",
    "model.layers.*.self_attn.k_norm": "replicated_with_grad_allreduce",
    "model.layers.*.mlp.experts.gate_up_proj": "packed_colwise",
    "model.layers.*.mlp.experts.down_proj": "rowwise",
    "model.layers.*.mlp.experts": "moe_tp_experts",
    "lm_head": "colwise_gather_output",
}
EP = {
    "model.layers.*.mlp.gate": "ep_router",
    "model.layers.*.mlp.experts.gate_up_proj": "grouped_gemm",
    "model.layers.*.mlp.experts.down_proj": "grouped_gemm",
    "model.layers.*.mlp.experts": "ep_dispatch_experts",
}
FSDP = {
    "model.embed_tokens": "free_full_weight",
    "model.layers.*": "free_full_weight",
    "model.norm": "keep_full_weight",
    "lm_head": "keep_full_weight",
}
DEFAULTS = DefaultPlans(tp=TP, ep=EP, fsdp=FSDP)


class Recording(ParallelStyle):
    """Accepts everything; records validate_param calls."""

    def __init__(self):
        self.seen = []

    def validate_param(self, module, param_name, param, mesh_size):
        self.seen.append((type(module).__name__, param_name, tuple(param.shape), mesh_size))


class DivisibleDim0(ParallelStyle):
    def validate_param(self, module, param_name, param, mesh_size):
        if param.shape[0] % mesh_size:
            raise ValueError(f"dim 0 of size {param.shape[0]} is not divisible by {mesh_size}")


class RecordingRouterMask(Recording):
    expert_role = ExpertRole.ROUTER_MASK


class RecordingPartialSum(Recording):
    expert_role = ExpertRole.EXPERTS_PARTIAL_SUM


class RecordingExpertShard(Recording):
    shards_experts = True


class RecordingDispatch(RecordingExpertShard):
    expert_role = ExpertRole.TOKEN_DISPATCH


# What each built-in name is, as a type: plan resolution reads these flags, never the names.
TYPED = {
    "ep_router": RecordingRouterMask,
    "moe_tp_experts": RecordingPartialSum,
    "grouped_gemm": RecordingExpertShard,
    "ep_dispatch_experts": RecordingDispatch,
}


@pytest.fixture
def registry():
    reg = StyleRegistry()
    for name in {*TP.values(), *EP.values(), "moe_tp_experts", "colwise_rep"}:
        reg.register(name, TYPED.get(name, Recording)())
    return reg


@pytest.fixture
def model():
    with torch.device("meta"):
        return CausalLM()


def resolve(model, registry, defaults=DEFAULTS, num_experts=E, **config):
    return resolve_plans(model, defaults, DistributedConfig(**config), num_experts=num_experts, registry=registry)


def layer_paths(suffix):
    return [f"model.layers.{i}.{suffix}" for i in range(LAYERS)]


# --- PLAN-1 / PLAN-3: merged plans exposed, overrides merge ----------------------------------


def test_defaults_are_exposed_when_no_override(model, registry):
    plans = resolve(model, registry, tp_size=2, fsdp_size=2, ep_size=2)
    assert plans.tp_plan == TP and plans.ep_plan == EP and plans.fsdp_plan == FSDP


def test_override_replaces_one_rule_and_keeps_the_rest(model, registry):
    plans = resolve(model, registry, tp_size=2, tp_plan={"model.layers.*.self_attn.q_proj": "colwise_rep"})
    assert plans.tp_plan == {**TP, "model.layers.*.self_attn.q_proj": "colwise_rep"}
    for path in layer_paths("self_attn.q_proj"):
        assert plans.tp_rules[path] == "colwise_rep"
    for path in layer_paths("self_attn.k_proj"):
        assert plans.tp_rules[path] == "colwise"


def test_fsdp_override_merges(model, registry):
    plans = resolve(model, registry, fsdp_size=2, fsdp_plan={"model.norm": "free_full_weight"})
    assert plans.fsdp_plan == {**FSDP, "model.norm": "free_full_weight"}
    assert (
        plans.fsdp_rules["model.layers.1"] == "free_full_weight" and plans.fsdp_rules["lm_head"] == "keep_full_weight"
    )


def test_resolution_does_not_touch_the_model(model, registry):
    before = {name: p for name, p in model.named_parameters()}
    resolve(model, registry, tp_size=2, fsdp_size=2, ep_size=2)
    after = dict(model.named_parameters())
    assert after.keys() == before.keys() and all(after[n] is before[n] for n in before)
    assert all(p.is_meta for p in after.values())


# --- PLAN-2: wildcards and prefixes ------------------------------------------------------------


def test_star_expands_to_every_layer_index_only(model, registry):
    plans = resolve(model, registry, tp_size=2)
    assert [p for p in plans.tp_rules if p.endswith("o_proj")] == layer_paths("self_attn.o_proj")


def test_exact_key_beats_wildcard(model, registry):
    plans = resolve(model, registry, tp_size=2, tp_plan={"model.layers.1.self_attn.q_proj": "colwise_rep"})
    assert plans.tp_rules["model.layers.0.self_attn.q_proj"] == "colwise"
    assert plans.tp_rules["model.layers.1.self_attn.q_proj"] == "colwise_rep"


def test_key_without_model_prefix_is_accepted_on_a_causal_lm(model, registry):
    plans = resolve(model, registry, tp_size=2, tp_plan={"layers.*.self_attn.q_proj": "colwise_rep"})
    assert plans.tp_plan["model.layers.*.self_attn.q_proj"] == "colwise_rep"
    assert "layers.*.self_attn.q_proj" not in plans.tp_plan


def test_key_with_model_prefix_is_accepted_on_a_base_model(registry):
    with torch.device("meta"):
        base = Base()
    base_defaults = DefaultPlans(tp={k.removeprefix("model."): v for k, v in TP.items() if k.startswith("model.")})
    plans = resolve(
        base, registry, base_defaults, tp_size=2, tp_plan={"model.layers.*.self_attn.q_proj": "colwise_rep"}
    )
    assert plans.tp_rules["layers.0.self_attn.q_proj"] == "colwise_rep"


def test_ambiguous_key_is_an_error(registry):
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = nn.ModuleDict({"head": nn.Linear(2, 2)})
            self.head = nn.Linear(2, 2)

    with pytest.raises(ValueError, match=r"'head' is ambiguous on Odd: both 'head' and 'model.head' match"):
        resolve(Odd(), registry, DefaultPlans(), tp_size=2, tp_plan={"head": "colwise_rep"})


# --- PLAN-4: errors and warnings -------------------------------------------------------------------


def test_override_key_matching_nothing_is_an_error_with_suggestions(model, registry):
    with pytest.raises(ValueError) as info:
        resolve(model, registry, tp_size=2, tp_plan={"model.layers.*.self_attn.qproj": "colwise"})
    message = str(info.value)
    assert "tp_plan override keys match no module, parameter or tp_plan entry of CausalLM" in message
    assert "'model.' prefix added or removed" in message
    assert "'model.layers.*.self_attn.qproj'; did you mean 'model.layers.*.self_attn.q_proj'" in message
    assert "[PLAN-4]" in message


def test_every_unmatched_key_is_listed_in_one_error(model, registry):
    with pytest.raises(ValueError) as info:
        resolve(model, registry, ep_size=2, fsdp_size=2, ep_plan={"a.b": "grouped_gemm", "c": "grouped_gemm"})
    assert "'a.b'" in str(info.value) and "'c'" in str(info.value)


def test_override_of_an_existing_plan_entry_that_matches_nothing_is_accepted(model, registry, caplog):
    defaults = DefaultPlans(tp={**TP, "model.layers.*.mlp.shared_expert": "colwise"}, ep=EP, fsdp=FSDP)
    with caplog.at_level(logging.WARNING, logger="raymoe.spec.plans"):
        plans = resolve(model, registry, defaults, tp_size=2, tp_plan={"model.layers.*.mlp.shared_expert": "rowwise"})
    assert plans.tp_plan["model.layers.*.mlp.shared_expert"] == "rowwise"
    assert "tp_plan rule 'model.layers.*.mlp.shared_expert' -> 'rowwise' matched nothing" in caplog.text


def test_unknown_style_lists_registered_names(model, registry):
    with pytest.raises(
        ValueError, match=r"tp_plan\['lm_head'\]: unknown style 'colwize'; registered styles: .*colwise"
    ):
        resolve(model, registry, tp_size=2, tp_plan={"lm_head": "colwize"})


def test_unknown_style_in_an_override_is_an_error_even_when_the_plan_is_inactive(model, registry):
    with pytest.warns(UserWarning), pytest.raises(ValueError, match="unknown style 'nope'"):
        resolve(model, registry, tp_size=1, tp_plan={"lm_head": "nope"})


def test_an_empty_registry_names_every_missing_style_once(model):
    with pytest.raises(ValueError, match=r"unknown style 'embedding_rowwise'; registered styles: none") as info:
        resolve_plans(model, DEFAULTS, DistributedConfig(tp_size=2), num_experts=E, registry=StyleRegistry())
    assert str(info.value).count("'colwise'") == 1


# --- what a style is comes from its type, not its name --------------------------------------------


def test_a_dispatch_style_under_any_name_selects_dispatch_and_marks_its_experts(model, registry):
    registry.register("my_dispatch", RecordingDispatch())
    plans = resolve(model, registry, fsdp_size=4, ep_size=2, ep_plan={"model.layers.*.mlp.experts": "my_dispatch"})
    assert plans.expert_mode == "dispatch"
    assert plans.ep_rules["model.layers.0.mlp.experts"] == "my_dispatch"
    assert not any(path.endswith("mlp.gate") for path in plans.ep_rules)  # the router mask is dropped (PLAN-6)
    assert plans.expert_modules == tuple(layer_paths("mlp.experts"))
    assert plans.styles["my_dispatch"] is registry["my_dispatch"]


def test_a_builtin_name_on_an_untyped_style_selects_nothing(model, registry):
    registry.register("ep_dispatch_experts", Recording(), replace=True)  # the name alone means nothing
    # Without dispatch, the default plan's router mask is all that is left: masking, missing its experts side.
    with pytest.raises(ValueError, match="on 2 routers and 0 expert modules"):
        resolve(model, registry, fsdp_size=4, ep_size=2)


class DispatchNotSharding(RecordingDispatch):
    shards_experts = False


def test_expert_modules_come_from_styles_that_shard_the_expert_dim(model, registry):
    registry.register("grouped_gemm", Recording(), replace=True)  # the parameter rules no longer shard experts...
    plans = resolve(model, registry, fsdp_size=4, ep_size=2)
    assert plans.expert_modules == tuple(layer_paths("mlp.experts"))  # ...the dispatch module rule still does
    registry.register("ep_dispatch_experts", DispatchNotSharding(), replace=True)
    assert resolve(model, registry, fsdp_size=4, ep_size=2).expert_modules == ()


def test_inactive_default_plans_need_no_registered_style(model):
    plans = resolve_plans(model, DEFAULTS, DistributedConfig(fsdp_size=2), num_experts=E, registry=StyleRegistry())
    assert plans.tp_rules == {} and plans.ep_rules == {} and plans.expert_mode == "none"


def test_uncovered_parameters_are_warned_once_with_wildcards(model, registry, caplog):
    with caplog.at_level(logging.WARNING, logger="raymoe.spec.plans"):
        resolve(model, registry, tp_size=2)
    records = [r for r in caplog.records if "covered by no plan rule" in r.getMessage()]
    assert len(records) == 1
    message = records[0].getMessage()
    assert "model.layers.*.input_layernorm.weight" in message and "model.norm.weight" in message
    assert "model.layers.0." not in message and "q_proj" not in message


def test_fsdp_plan_values_and_targets_are_checked(model, registry):
    with pytest.raises(ValueError, match=r"fsdp_plan values must be one of .*'model.norm': 'shard'"):
        resolve(model, registry, fsdp_size=2, fsdp_plan={"model.norm": "shard"})
    with pytest.raises(ValueError, match=r"fsdp_plan keys must name modules.*'model.norm.weight'"):
        resolve(model, registry, fsdp_size=2, fsdp_plan={"model.norm.weight": "keep_full_weight"})


# --- PLAN-5: which plan applies, EP over TP -----------------------------------------------------


def test_tp_plan_applies_only_when_tp_size_above_one(model, registry):
    assert resolve(model, registry, fsdp_size=2, ep_size=2).tp_rules == {}
    assert resolve(model, registry, tp_size=2).tp_rules != {}


def test_tp_without_ep_applies_the_full_tp_plan_including_expert_rules(model, registry):
    plans = resolve(model, registry, tp_size=2)
    assert plans.ep_rules == {} and plans.expert_mode == "none"
    assert plans.tp_rules["model.layers.0.mlp.experts"] == "moe_tp_experts"
    assert plans.tp_rules["model.layers.1.mlp.experts.gate_up_proj"] == "packed_colwise"


def test_ep_rules_win_over_tp_rules_on_the_same_modules_and_children(model, registry):
    plans = resolve(model, registry, tp_size=2, fsdp_size=2, ep_size=2)
    assert not [p for p in plans.tp_rules if ".mlp.experts" in p]
    assert plans.ep_rules["model.layers.0.mlp.experts.gate_up_proj"] == "grouped_gemm"
    assert plans.tp_rules["model.layers.0.self_attn.q_proj"] == "colwise"


def test_expert_parameters_are_sharded_exactly_once(model, registry):
    plans = resolve(model, registry, tp_size=2, fsdp_size=2, ep_size=4)
    for path in [*layer_paths("mlp.experts.gate_up_proj"), *layer_paths("mlp.experts.down_proj")]:
        assert (path in plans.tp_rules) + (path in plans.ep_rules) == 1


# --- PLAN-6: dispatch vs masking --------------------------------------------------------------------


def test_dispatch_ignores_the_router_rule(model, registry):
    plans = resolve(model, registry, tp_size=2, fsdp_size=2, ep_size=4)
    assert plans.expert_mode == "dispatch"
    assert not [p for p in plans.ep_rules if p.endswith("mlp.gate")]


def test_masking_override_on_a_dispatch_default_model(model, registry):
    plans = resolve(
        model, registry, tp_size=2, fsdp_size=2, ep_size=2, ep_plan={"layers.*.mlp.experts": "moe_tp_experts"}
    )
    assert plans.expert_mode == "masking"
    assert plans.ep_rules["model.layers.0.mlp.gate"] == "ep_router"
    assert plans.ep_rules["model.layers.0.mlp.experts"] == "moe_tp_experts"


def test_masking_with_ep_above_tp_is_cfg4(model, registry):
    with pytest.raises(ValueError, match=r"ep_size == tp_size, got ep_size=4, tp_size=2.*\[CFG-4\]"):
        resolve(
            model, registry, tp_size=2, fsdp_size=2, ep_size=4, ep_plan={"model.layers.*.mlp.experts": "moe_tp_experts"}
        )


def test_masking_needs_a_router_mask_for_every_masked_expert(model, registry):
    ep_plan = {"model.layers.*.mlp.experts": "moe_tp_experts", "model.layers.*.mlp.gate": "grouped_gemm"}
    with pytest.raises(ValueError, match=r"on 0 routers and 2 expert modules \[PLAN-6\]"):
        resolve(model, registry, tp_size=2, ep_size=2, ep_plan=ep_plan)


def test_ep_plan_without_a_mechanism_is_an_error(model, registry):
    defaults = DefaultPlans(tp=TP, ep={"model.layers.*.mlp.experts.gate_up_proj": "grouped_gemm"}, fsdp=FSDP)
    with pytest.raises(ValueError, match=r"selects no expert-parallel mechanism"):
        resolve(model, registry, defaults, tp_size=2, ep_size=2)


def test_dispatch_with_pipeline_is_cfg5(model, registry):
    with pytest.raises(ValueError, match=r"\[CFG-5\]"):
        resolve(model, registry, tp_size=2, ep_size=2, pp_size=2)


# --- CFG-3 bound to the model, CFG-6 end to end -----------------------------------------------------


def test_ep_size_must_divide_num_experts(model, registry):
    with pytest.raises(ValueError, match=r"ep_size=4 must divide the model's num_experts=6 \[CFG-3\]"):
        resolve(model, registry, num_experts=6, tp_size=2, fsdp_size=2, ep_size=4)


def test_ep_on_a_dense_model_is_an_error(model, registry):
    with pytest.raises(ValueError, match=r"ep_size=2 but the model has no experts"):
        resolve(model, registry, num_experts=None, fsdp_size=2, ep_size=2)


def test_enable_expert_parallel_shards_experts_and_nothing_else(model, registry):
    with pytest.warns(FutureWarning):
        config = DistributedConfig(tp_size=2, enable_expert_parallel=True)
    plans = resolve_plans(model, DEFAULTS, config, num_experts=E, registry=registry)
    assert plans.tp_plan == {} and plans.tp_rules == {}
    assert plans.expert_mode == "dispatch"
    assert set(plans.ep_rules) == {
        *layer_paths("mlp.experts"),
        *layer_paths("mlp.experts.gate_up_proj"),
        *layer_paths("mlp.experts.down_proj"),
    }


def test_deferred_config_must_be_resolved_first(model, registry):
    with pytest.raises(ValueError, match=r"call config.resolve\(world_size\)"):
        resolve(model, registry, tp_plan="auto")


# --- validate_param (STYLE-1) and custom styles (STYLE-2) -----------------------------------------


def test_validate_param_sees_every_covered_parameter_with_the_mesh_size(model, registry):
    resolve(model, registry, tp_size=2, fsdp_size=2, ep_size=4)
    grouped = registry.get("grouped_gemm").seen
    assert ("Experts", "gate_up_proj", (E, 2 * INTER, H), 4) in grouped and len(grouped) == 2 * LAYERS
    dispatch = registry.get("ep_dispatch_experts").seen  # a module rule sees the module's own parameters
    assert sorted({name for _, name, _, _ in dispatch}) == ["down_proj", "gate_up_proj"]
    assert ("Linear", "weight", (H, H), 2) in registry.get("colwise").seen


def test_custom_style_named_in_a_plan_is_applied_and_can_reject(model, registry):
    registry.register("colwise_custom", DivisibleDim0())
    plans = resolve(model, registry, tp_size=2, tp_plan={"lm_head": "colwise_custom"})
    assert plans.tp_rules["lm_head"] == "colwise_custom"
    with pytest.raises(ValueError) as info:
        resolve(model, registry, tp_size=3, tp_plan={"lm_head": "colwise_custom"})
    assert str(info.value) == (
        "tp_plan rule 'lm_head' -> 'colwise_custom' cannot shard weight (16, 8) over tp_size=3: "
        "dim 0 of size 16 is not divisible by 3"
    )
