"""DistributedConfig: every CFG rule, with the exact exception type and the offending field in the message."""

import json
import warnings

import pytest

from raymoe import DistributedConfig


def make(**kwargs):
    return DistributedConfig(**kwargs)


def test_defaults_are_one_rank():
    config = make()
    assert (config.tp_size, config.fsdp_size, config.dp_replicate_size, config.pp_size, config.ep_size) == (1,) * 5
    assert config.world_size == 1 and config.dp_size == 1 and config.efsdp_size == 1


# --- CFG-1: world size ---------------------------------------------------------------------------


def test_world_size_is_product_of_sizes_and_ep_adds_no_rank():
    config = make(dp_replicate_size=2, fsdp_size=2, tp_size=2, ep_size=4)
    assert config.world_size == 8
    assert config.dp_size == 4
    assert config.efsdp_size == 1


def test_resolve_rejects_a_world_size_that_is_not_the_product():
    with pytest.raises(ValueError, match=r"world_size=6 must equal .* = 8 \[CFG-1\]"):
        make(tp_size=2, fsdp_size=4).resolve(6)


def test_resolve_returns_same_config_when_world_matches():
    config = make(tp_size=2, fsdp_size=4)
    assert config.resolve(8) is config


@pytest.mark.parametrize("world", [0, -1, True, 2.0, "8"])
def test_resolve_rejects_non_positive_int_world(world):
    with pytest.raises(ValueError, match="world_size must be a positive int"):
        make().resolve(world)


# --- CFG-2: defaults -----------------------------------------------------------------------------


def test_tp_size_is_inferred_from_world_with_auto_plan():
    config = make(tp_plan="auto", fsdp_size=2)
    assert config.tp_size is None and config.tp_is_deferred
    with pytest.raises(ValueError, match=r"tp_size=None .*resolve\(world_size\)"):
        _ = config.world_size
    resolved = config.resolve(8)
    assert resolved.tp_size == 4 and resolved.world_size == 8 and resolved.tp_plan == "auto"


def test_inferred_tp_size_must_divide_world():
    with pytest.raises(ValueError, match=r"world_size=6 is not divisible by 1 \* 4 \* 1 = 4 \[CFG-2\]"):
        make(tp_plan="auto", fsdp_size=4).resolve(6)


def test_inferred_tp_size_is_checked_against_ep_size():
    with pytest.raises(ValueError, match=r"ep_size=4 must be a multiple of tp_size=8 \[CFG-3\]"):
        make(tp_plan="auto", ep_size=4).resolve(8)


def test_sizes_default_to_one_when_another_is_set():
    config = make(tp_size=4)
    assert (config.fsdp_size, config.pp_size, config.dp_replicate_size, config.ep_size) == (1, 1, 1, 1)


# --- CFG-3: ep divisibility ----------------------------------------------------------------------


def test_ep_must_be_multiple_of_tp():
    with pytest.raises(ValueError, match=r"ep_size=3 must be a multiple of tp_size=2 \[CFG-3\]"):
        make(tp_size=2, fsdp_size=3, ep_size=3)


def test_ep_must_divide_fsdp_times_tp():
    with pytest.raises(ValueError, match=r"ep_size=8 must divide fsdp_size \* tp_size = 2 \* 2 = 4 \[CFG-3\]"):
        make(tp_size=2, fsdp_size=2, ep_size=8)


@pytest.mark.parametrize(("tp", "fsdp", "ep", "efsdp"), [(2, 4, 2, 4), (2, 4, 4, 2), (2, 4, 8, 1), (1, 8, 4, 2)])
def test_efsdp_size(tp, fsdp, ep, efsdp):
    assert make(tp_size=tp, fsdp_size=fsdp, ep_size=ep).efsdp_size == efsdp


# --- CFG-4 / CFG-5: rules tied to the EP mechanism ----------------------------------------------


def test_masking_needs_ep_equal_tp():
    make(tp_size=2, fsdp_size=2, ep_size=2).check_expert_mode("masking")
    with pytest.raises(ValueError, match=r"ep_size == tp_size, got ep_size=4, tp_size=2.*\[CFG-4\]"):
        make(tp_size=2, fsdp_size=2, ep_size=4).check_expert_mode("masking")


def test_dispatch_allows_ep_above_tp_but_not_pipeline():
    make(tp_size=2, fsdp_size=2, ep_size=4).check_expert_mode("dispatch")
    with pytest.raises(ValueError, match=r"pp_size=2 \[CFG-5\]"):
        make(tp_size=2, ep_size=2, pp_size=2).check_expert_mode("dispatch")


MASKED_PLAN = {"model.layers.*.mlp.gate": "ep_router", "model.layers.*.mlp.experts": "moe_tp_experts"}
DISPATCH_PLAN = {"model.layers.*.mlp.experts": "ep_dispatch_experts"}


def test_an_override_that_decides_masking_is_checked_at_construction():
    DistributedConfig(tp_size=2, fsdp_size=2, ep_size=2, ep_plan=MASKED_PLAN)
    with pytest.raises(ValueError, match=r"ep_size == tp_size, got ep_size=4, tp_size=2.*\[CFG-4\]"):
        DistributedConfig(tp_size=2, fsdp_size=2, ep_size=4, ep_plan=MASKED_PLAN)


def test_an_override_that_decides_dispatch_is_checked_at_construction():
    DistributedConfig(tp_size=2, fsdp_size=2, ep_size=4, ep_plan=DISPATCH_PLAN)
    with pytest.raises(ValueError, match=r"pp_size=2 \[CFG-5\]"):
        DistributedConfig(tp_size=2, ep_size=2, pp_size=2, ep_plan=DISPATCH_PLAN)


def test_the_mechanism_comes_from_the_style_types_not_their_names():
    from raymoe import ExpertRole, ParallelStyle, register
    from raymoe.parallel.styles import STYLES

    class Dispatcher(ParallelStyle):
        expert_role = ExpertRole.TOKEN_DISPATCH

    register("my_dispatch", Dispatcher())
    try:
        with pytest.raises(ValueError, match=r"\[CFG-5\]"):
            DistributedConfig(tp_size=2, ep_size=2, pp_size=2, ep_plan={"model.layers.*.mlp.experts": "my_dispatch"})
    finally:
        STYLES.unregister("my_dispatch")


def test_overrides_that_do_not_decide_the_mechanism_wait_for_the_model():
    # Half a masking plan, an unknown name, or a deferred tp_size: the model's defaults or PLAN-4 decide later.
    DistributedConfig(tp_size=2, fsdp_size=2, ep_size=4, ep_plan={"model.layers.*.mlp.gate": "ep_router"})
    DistributedConfig(tp_size=2, ep_size=2, pp_size=2, ep_plan={"model.layers.*.mlp.experts": "nonexistent"})
    DistributedConfig(tp_plan="auto", ep_size=4, ep_plan=MASKED_PLAN)


# --- CFG-6: deprecated enable_expert_parallel ---------------------------------------------------


def test_enable_expert_parallel_means_ep_equal_tp_and_no_tp_rules():
    with pytest.warns(FutureWarning, match=r"ep_size=2, tp_plan=\{\}"):
        config = make(tp_size=2, enable_expert_parallel=True)
    assert (config.ep_size, config.tp_plan, config.tp_size, config.fsdp_size) == (2, {}, 2, 1)
    assert config.enable_expert_parallel is False  # fully expressed by ep_size and tp_plan now


def test_enable_expert_parallel_keeps_an_explicit_tp_plan():
    with pytest.warns(FutureWarning):
        config = make(tp_size=2, tp_plan="auto", enable_expert_parallel=True)
    assert config.tp_plan == "auto" and config.ep_size == 2


def test_enable_expert_parallel_never_changes_tp_or_fsdp():
    with pytest.warns(FutureWarning):
        config = make(tp_size=4, fsdp_size=2, enable_expert_parallel=True)
    assert (config.tp_size, config.fsdp_size, config.ep_size, config.world_size) == (4, 2, 4, 8)


def test_explicit_ep_size_wins_over_enable_expert_parallel():
    with pytest.warns(FutureWarning, match="ep_size=4 is set explicitly and wins"):
        config = make(tp_size=2, fsdp_size=2, ep_size=4, enable_expert_parallel=True)
    assert config.ep_size == 4 and config.tp_plan is None


def test_enable_expert_parallel_without_tp_is_an_error():
    with pytest.raises(ValueError, match=r"enable_expert_parallel=True .* tp_size=None.*\[CFG-6\]"):
        make(enable_expert_parallel=True)


def test_enable_expert_parallel_round_trip_warns_once():
    with pytest.warns(FutureWarning):
        config = make(tp_size=2, enable_expert_parallel=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert DistributedConfig.from_dict(config.to_dict()) == config


def test_deprecation_warning_points_at_the_caller():
    with pytest.warns(FutureWarning) as record:
        make(tp_size=2, enable_expert_parallel=True)
    assert record[0].filename == __file__


# --- CFG-7: plans never infer sizes --------------------------------------------------------------


def test_tp_plan_override_without_tp_size_is_an_error():
    with pytest.raises(ValueError, match=r"tp_plan overrides \['lm_head'\] were given with tp_size=None.*\[CFG-7\]"):
        make(tp_plan={"lm_head": "colwise_rep"})


def test_ep_plan_without_ep_size_is_an_error():
    with pytest.raises(ValueError, match=r"ep_plan overrides .* with ep_size=None.*\[CFG-7\]"):
        make(tp_size=2, ep_plan={"model.layers.*.mlp.gate": "ep_router"})


def test_plan_with_size_one_warns_that_it_is_ignored():
    with pytest.warns(UserWarning, match=r"ep_plan overrides are ignored because ep_size=1.*\[PLAN-5\]"):
        make(ep_size=1, ep_plan={"model.layers.*.mlp.gate": "ep_router"})
    with pytest.warns(UserWarning, match=r"tp_plan overrides are ignored because tp_size=1"):
        make(tp_size=1, tp_plan={"lm_head": "colwise_rep"})


def test_empty_tp_plan_means_no_rules_and_needs_no_size():
    assert make(tp_plan={}).tp_size == 1


# --- CFG-8: every violation is a ValueError naming the field and value --------------------------


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"tp_size": 0}, ["tp_size=0", "greater than or equal to 1"]),
        ({"fsdp_size": -2}, ["fsdp_size=-2"]),
        ({"ep_size": "2"}, ["ep_size='2'", "valid integer"]),
        ({"dp_replicate_size": True}, ["dp_replicate_size=True"]),
        ({"pp_size": 1.5}, ["pp_size=1.5"]),
        ({"fsdp_cpu_offload": "yes"}, ["fsdp_cpu_offload='yes'"]),
        ({"tp_size": 2, "tp_plan": "colwise"}, ["tp_plan", "'colwise'", "'auto'"]),
        ({"tp_size": 2, "tp_plan": {"lm_head": 3}}, ["tp_plan", "lm_head", "valid string"]),
        ({"fsdp_plan": ["model.layers.*"]}, ["fsdp_plan", "valid dictionary"]),
        ({"tp_size": 2, "tp_plan": {"": "colwise"}}, ["non-empty key and style"]),
        ({"ep_szie": 2}, ["ep_szie=2", "Extra inputs are not permitted"]),
    ],
)
def test_bad_values_name_the_field(kwargs, names):
    with pytest.raises(ValueError) as info:
        make(**kwargs)
    assert type(info.value) is ValueError  # one plain error, no pydantic wrapper
    for name in names:
        assert name in str(info.value)


def test_config_is_frozen():
    config = make(tp_size=2)
    with pytest.raises(ValueError, match="frozen"):
        config.tp_size = 4


# --- CFG-9: sequence parallelism inside TP; CFG-11: context parallelism ------------------------------


def test_enable_sequence_parallel_needs_a_tp_group():
    assert make(tp_size=2, enable_sequence_parallel=True).enable_sequence_parallel
    with pytest.raises(ValueError, match=r"enable_sequence_parallel=True .* but tp_size=1; .*use cp_size\) \[CFG-9\]"):
        make(enable_sequence_parallel=True)
    with pytest.raises(ValueError, match=r"tp_size=1.*\[CFG-9\]"):
        make(tp_size=1, fsdp_size=2, enable_sequence_parallel=True)


def test_a_deferred_tp_size_is_checked_for_sequence_parallelism_when_resolved():
    config = make(tp_plan="auto", fsdp_size=2, enable_sequence_parallel=True)
    assert config.resolve(4).tp_size == 2
    with pytest.raises(ValueError, match=r"\[CFG-9\]"):
        config.resolve(2)


def test_cp_size_adds_ranks_and_joins_the_expert_groups():
    config = make(cp_size=2, fsdp_size=2, ep_size=4)
    assert (config.world_size, config.dp_size, config.efsdp_size, config.splits_sequences) == (4, 2, 1, True)
    assert not make(fsdp_size=2).splits_sequences
    assert make(cp_size=2, tp_size=2).world_size == 4
    assert make(tp_plan="auto", cp_size=2).resolve(8).tp_size == 4


@pytest.mark.parametrize(
    ("sizes", "message"),
    [
        (
            {"cp_size": 2, "ep_size": 8},
            r"ep_size=8 must divide fsdp_size \* cp_size \* tp_size = 1 \* 2 \* 1 = 2 \[CFG-3\]",
        ),
        ({"cp_size": 0}, r"cp_size=0: Input should be greater than or equal to 1"),
        ({"cp_size": 2, "cp_mode": "rings"}, r"cp_mode='rings'"),
        ({"cp_size": 2, "tp_size": 2, "ep_size": 4, "ep_plan": MASKED_PLAN}, r"ep_size == tp_size.*\[CFG-4\]"),
    ],
)
def test_bad_context_parallel_layouts_are_one_clear_error(sizes, message):
    with pytest.raises(ValueError, match=message):
        make(**sizes)


def test_world_size_rule_names_cp_size_only_when_it_is_set():
    with pytest.raises(
        ValueError, match=r"fsdp_size \* cp_size \* tp_size \* pp_size = 1 \* 2 \* 2 \* 2 \* 1 = 8 \[CFG-1\]"
    ):
        make(fsdp_size=2, cp_size=2, tp_size=2).resolve(4)
    with pytest.raises(ValueError, match=r"fsdp_size \* tp_size \* pp_size = 1 \* 2 \* 1 \* 1 = 2 \[CFG-1\]"):
        make(fsdp_size=2).resolve(4)


def test_cp_mode_without_cp_warns_that_it_is_ignored():
    with pytest.warns(UserWarning, match=r"cp_mode='all_to_all' is ignored because cp_size=1: .*\[CFG-11\]"):
        make(cp_mode="all_to_all")


# --- serialisation ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"tp_size": 2, "fsdp_size": 4, "ep_size": 4},
        {"tp_plan": "auto", "fsdp_size": 2},
        {"tp_size": 2, "tp_plan": {"lm_head": "colwise_rep"}, "fsdp_plan": {"model.norm": "keep_full_weight"}},
        {"dp_replicate_size": 2, "fsdp_size": 2, "ep_size": 2, "ep_plan": {"x": "grouped_gemm"}},
        {"fsdp_size": 2, "fsdp_mixed_precision": True, "fsdp_cpu_offload": True},
    ],
)
def test_dict_and_json_round_trip(kwargs):
    config = make(**kwargs)
    assert DistributedConfig.from_dict(config.to_dict()) == config
    assert DistributedConfig.from_json(config.to_json()) == config
    assert json.loads(config.to_json()) == config.to_dict()


def test_from_json_rejects_bad_json_and_non_dicts():
    with pytest.raises(ValueError, match="not valid JSON"):
        DistributedConfig.from_json("{tp_size: 2")
    with pytest.raises(ValueError, match="needs a dict, got list"):
        DistributedConfig.from_json("[2]")


def test_repr_shows_sizes_and_non_default_fields_only():
    text = repr(make(tp_size=2, fsdp_size=4, ep_size=4, fsdp_mixed_precision=True))
    assert text == (
        "DistributedConfig(dp_replicate_size=1, fsdp_size=4, cp_size=1, tp_size=2, ep_size=4, pp_size=1, "
        "fsdp_mixed_precision=True)"
    )
