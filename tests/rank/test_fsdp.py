"""FSDP2 options and training metrics through the handle: mixed precision, CPU offload, expert load (LB-1)."""

import collections
import copy
import json
import sys

import pytest
import torch
from ray import cloudpickle
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule

from raymoe.checkpoint import load_model
from raymoe.rank.balance import routers

cloudpickle.register_pickle_by_value(sys.modules[__name__])

MOE = "moe_e8_k2_mha"


def batch(vocab, rows=4, seq=8, seed=0):
    return torch.randint(0, vocab, (rows, seq), generator=torch.Generator().manual_seed(seed))


def reference_step_loss(directory, load_hf_model, ids):
    model = copy.deepcopy(load_hf_model(directory)).train()
    return model(input_ids=ids, labels=ids).loss.item()


def storage_facts(ctx):
    """Where and in which dtype this rank keeps parameters and optimizer state, and its FSDP policies."""
    model = ctx.require_model().model
    training = ctx.require_model().training
    optimizer = training.optimizer if training is not None else None
    states = [t for state in (optimizer.state.values() if optimizer else []) for t in state.values() if t.dim() > 0]
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    return {
        "param_dtypes": {str(p.dtype) for p in model.parameters()},
        "param_devices": {p.device.type for p in model.parameters()},
        "state_devices": {t.device.type for t in states},
        "offloaded": all(
            isinstance(u._get_fsdp_state()._fsdp_param_group.offload_policy, CPUOffloadPolicy)
            for u in units
            if u._get_fsdp_state()._fsdp_param_group
        ),
        "compute_dtypes": {
            str(u._get_fsdp_state()._fsdp_param_group.mp_policy.param_dtype)
            for u in units
            if u._get_fsdp_state()._fsdp_param_group
        },
    }


def test_mixed_precision_computes_in_bf16_and_keeps_fp32_weights(load_on_world, tiny_checkpoint, load_hf_model):
    directory = tiny_checkpoint(MOE)
    ids = batch(96)
    expected = reference_step_loss(directory, load_hf_model, ids)
    config = {"fsdp_size": 2, "fsdp_mixed_precision": True}
    with load_on_world(directory, config) as model:
        assert model(ids).dtype == torch.bfloat16
        model.configure_training()
        loss = model.train_step(ids)["loss"]
        facts = model.run_on_ranks(storage_facts)[0]
    assert facts["param_dtypes"] == {"torch.float32"} and facts["compute_dtypes"] == {"torch.bfloat16"}
    assert abs(loss - expected) <= 2e-2 * expected and loss != expected


def test_cpu_offload_materialises_shards_on_the_host_whatever_device_computes():
    """FSDP2 with CPU offload refuses shards materialised on the GPU (found on an H200: every offloaded load failed at
    its first step); without offload the shards live where the rank computes."""
    from raymoe.rank.load import parameter_home
    from raymoe.spec.config import DistributedConfig

    cuda = torch.device("cuda", 0)
    assert parameter_home(DistributedConfig(fsdp_cpu_offload=True), cuda) == torch.device("cpu")
    assert parameter_home(DistributedConfig(), cuda) == cuda
    assert parameter_home(DistributedConfig(), torch.device("cpu")) == torch.device("cpu")


def test_fsdp_units_read_their_groups_on_torch_2_11_and_2_13():
    """torch 2.13 keeps a list of parameter groups per unit; 2.11 (the GPU image of our device machine) one optional
    group: raymoe's gathered-bytes count and keep_unsharded read either."""
    from types import SimpleNamespace

    from raymoe.parallel.fsdp import _param_groups

    group = object()
    assert _param_groups(SimpleNamespace(_fsdp_param_groups=[group])) == [group]
    assert _param_groups(SimpleNamespace(_fsdp_param_group=group)) == [group]
    assert _param_groups(SimpleNamespace(_fsdp_param_group=None)) == []


def test_cpu_offload_keeps_weights_and_optimizer_state_on_cpu(load_on_world, tiny_checkpoint, load_hf_model):
    directory = tiny_checkpoint(MOE)
    ids = batch(96)
    expected = reference_step_loss(directory, load_hf_model, ids)
    with load_on_world(directory, {"fsdp_size": 2, "fsdp_cpu_offload": True}) as model:
        model.configure_training()
        loss = model.train_step(ids)["loss"]
        facts = model.run_on_ranks(storage_facts)[0]
    assert facts["offloaded"] and facts["param_devices"] == {"cpu"} and facts["state_devices"] == {"cpu"}
    assert facts["compute_dtypes"] == {"None"}
    assert abs(loss - expected) <= 1e-5 * expected


@pytest.mark.parametrize("config", [{"tp_size": 2, "fsdp_size": 2}], ids=["tp2-fsdp2"])
def test_expert_load_metrics_count_every_routed_token_once(load_on_world, tiny_checkpoint, config):
    directory = tiny_checkpoint(MOE)
    ids = batch(96, rows=4, seq=8, seed=5)
    single = load_model(directory).train()
    for router in routers(single):
        router.record = True
    with torch.no_grad():
        single(ids)
    expected = torch.stack([r.last_load for r in routers(single)])  # [layers, experts]
    with load_on_world(directory, config) as model:
        model.configure_training()
        metrics = model.train_step(ids)
    assert torch.equal(torch.tensor(metrics["expert_load"]), expected)
    assert all(sum(layer) == 4 * 8 * 2 for layer in metrics["expert_load"])  # tokens x top-2
    mean = expected.double().mean(dim=1)
    assert metrics["expert_imbalance"] == pytest.approx((expected.double().max(dim=1).values / mean).tolist())
    # without expert parallelism each rank runs all experts on its own batch: 2 rows x 8 tokens x top-2
    assert metrics["rank_load"] == [[32] * 4] * len(expected)
    assert metrics["rank_imbalance"] == [1.0] * len(expected)


def fsdp_units(ctx):
    """Path of every FSDP module -> whether its unit frees its gathered weights after forward, its mesh
    size, and the unit's id (modules wrapped together share one)."""
    model = ctx.require_model().model
    units = {}
    for path, module in model.named_modules():
        if isinstance(module, FSDPModule):
            group = module._get_fsdp_state()._fsdp_param_group
            if group is not None:
                frees = group.post_forward_mesh_info is not None
                units[path or "<root>"] = (frees, group.mesh_info.mesh.size(), id(group))
    return units


def test_fsdp_plan_and_expert_units_follow_the_layout(load_on_world, tiny_checkpoint):
    config = {
        "fsdp_size": 4,
        "ep_size": 2,
        "fsdp_plan": {"model.layers.*": "keep_full_weight"},
        "fsdp_reshard_after_forward": "always",  # the plan's strategies, as written
    }
    with load_on_world(tiny_checkpoint(MOE), config) as model:
        found = model.run_on_ranks(fsdp_units)[0]
    units = {path: unit[:2] for path, unit in found.items()}
    assert units["model.layers.0"] == (False, 4) and units["model.layers.1"] == (False, 4)  # the override
    assert units["model.embed_tokens"] == (True, 4) and units["lm_head"] == (False, 4)  # the defaults
    # experts: their own units over efsdp = fsdp * tp / ep = 2
    assert units["model.layers.0.mlp.experts"] == (True, 2) and units["model.layers.1.mlp.experts"] == (True, 2)
    # the final norm and the head share one unit; each block keeps its own so backward can overlap
    assert found["model.norm"][2] == found["lm_head"][2]
    assert len({found[path][2] for path in ("model.embed_tokens", "model.layers.0", "model.layers.1", "lm_head")}) == 4


@pytest.mark.parametrize(
    ("rules", "shared"),
    [
        # the defaults: the final norm and the head share a unit
        (
            {"model.layers.0": "free_full_weight", "model.norm": "keep_full_weight", "lm_head": "keep_full_weight"},
            ["model.norm", "lm_head"],
        ),
        # blocks of the layer list keep their own units, so backward can reduce-scatter each as it finishes
        (
            {"model.layers.0": "keep_full_weight", "model.layers.1": "keep_full_weight", "lm_head": "keep_full_weight"},
            ["lm_head"],
        ),
        # a module inside another rule's module already belongs to that unit
        (
            {
                "model.layers.0": "keep_full_weight",
                "model.layers.0.mlp": "keep_full_weight",
                "model.norm": "keep_full_weight",
            },
            ["model.norm"],
        ),
    ],
)
def test_only_single_top_level_kept_modules_share_a_unit(tiny_checkpoint, rules, shared):
    from raymoe.models import build_model, parse_model_config
    from raymoe.parallel.fsdp import _keep_group

    config = parse_model_config(json.loads((tiny_checkpoint(MOE) / "config.json").read_text()))
    assert _keep_group(build_model(config), rules) == shared


@pytest.mark.parametrize("choice", ["always", "never", "auto"])
def test_reshard_after_forward_chooses_the_units_that_keep_their_weights(load_on_world, tiny_checkpoint, choice):
    """``always``: the plan's strategies; ``never``: every unit keeps; ``auto`` on a model this small beside the host's
    memory: every unit keeps (every rank agreeing), experts' units too."""
    config = {"fsdp_size": 4, "ep_size": 2, "fsdp_reshard_after_forward": choice}
    with load_on_world(tiny_checkpoint(MOE), config) as model:
        found = model.run_on_ranks(fsdp_units)
        assert {report.keeps_gathered for report in model.load_reports} == {choice != "always"}
        picture = model.picture()
    assert f"fsdp_reshard_after_forward={choice}): " in picture
    assert ("every unit keeps its gathered weights" in picture) == (choice != "always")
    for units in found:
        frees = {path: unit[0] for path, unit in units.items()}
        kept = {"<root>", "model.norm", "lm_head"}  # the root's own choice (FSDP2) and the plan's keep_full_weight
        assert frees == {path: choice == "always" and path not in kept for path in frees}, frees
        assert {"model.layers.1", "model.layers.1.mlp.experts", "model.embed_tokens"} <= set(frees)


def start_counting(ctx):
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    profiler.start()
    ctx.test_profiler = profiler  # on the rank's context: this function travels by value


def all_gathers(ctx):
    """Unit -> the all-gathers FSDP2 ran for it since :func:`start_counting`."""
    ctx.test_profiler.stop()
    names = [event.name for event in ctx.test_profiler.events() if event.name.startswith("FSDP::all_gather (")]
    return dict(collections.Counter(name.removeprefix("FSDP::all_gather (").removesuffix(")") for name in names))


@pytest.mark.parametrize("choice", ["always", "auto"])
def test_a_unit_that_keeps_its_weights_gathers_once_a_step_and_trains_the_same(
    load_on_world, tiny_checkpoint, load_hf_model, choice
):
    directory = tiny_checkpoint(MOE)
    ids = batch(96, rows=4)
    with load_on_world(directory, {"fsdp_size": 2, "fsdp_reshard_after_forward": choice}) as model:
        model.configure_training(lr=1e-2)
        first = model.train_step(ids)
        model.run_on_ranks(start_counting)
        second = model.train_step(ids)
        counts = model.run_on_ranks(all_gathers)
    layers = {"model.embed_tokens", "model.layers.0", "model.layers.1"}
    for per_unit in counts:
        assert per_unit["model.norm, lm_head"] == 1
        assert {unit: per_unit[unit] for unit in layers} == dict.fromkeys(layers, 2 if choice == "always" else 1)
    # one process's numbers whatever the choice: the loss before and after an update (test_layouts checks more)
    assert first["loss"] == pytest.approx(reference_step_loss(directory, load_hf_model, ids), rel=1e-5)
    assert second["loss"] < first["loss"]


def test_auto_keeps_only_the_last_layer_where_memory_is_short(load_local, tiny_checkpoint, monkeypatch):
    """Where the gathered weights exceed 1/8 of the free memory, ``auto`` keeps the plan's units and the last decoder
    layer (one rank in this process, FSDP2 wrapping for the bf16-mixed policy's casts)."""
    import raymoe.rank.gathered

    monkeypatch.setattr(raymoe.rank.gathered, "free_memory", lambda ctx: 1)
    with load_local(tiny_checkpoint(MOE), dtype=torch.bfloat16) as model:
        frees = {path: unit[0] for path, unit in model.run_on_ranks(fsdp_units)[0].items()}
        assert model.load_reports[0].keeps_gathered is False
        assert "as the fsdp plan says, and the last decoder layer" in model.picture()
    assert frees["model.layers.0"] and frees["model.embed_tokens"]
    assert not frees["model.layers.1"] and not frees["lm_head"]
