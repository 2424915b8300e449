"""``raymoe.plan``'s exact part equals what loaded ranks hold (issue 34): per rank, the bytes and elements of every
parameter's local shard, of the gradients a backward leaves, and of AdamW's states after a step, for the layout
matrix of tests/rank/test_layouts.py on Qwen3-MoE and layouts of gpt-oss and DeepSeek-V3 (and LoRA, MXFP4 experts
kept packed, pipelines). Planned in a fake world on meta, from config.json alone; measured on real Ray ranks."""

import pytest
import torch

from raymoe import plan
from raymoe.rank.contract import MicroBatch
from raymoe.rank.fake import fake_world
from raymoe.rank.footprint import held_memory
from raymoe.spec.config import DistributedConfig

pytestmark = pytest.mark.world_of_8  # one block with the world of 8 ranks' other users (tests/conftest.py)

MOE = "moe_e8_k2_mha"
MASKED = {"model.layers.*.mlp.gate": "ep_router", "model.layers.*.mlp.experts": "moe_tp_experts"}
ROWS, SEQ = 4, 8
LORA = {
    "r": 4,
    "target_modules": ["q_proj", "o_proj"],
    "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
}

QWEN3_LAYOUTS = {
    "single": {},
    "tp2-fsdp2-ep2": {"tp_size": 2, "fsdp_size": 2, "ep_size": 2},
    "fsdp4-ep4": {"fsdp_size": 4, "ep_size": 4},
    "fsdp4-ep2": {"fsdp_size": 4, "ep_size": 2},
    "tp2-fsdp2-ep4": {"tp_size": 2, "fsdp_size": 2, "ep_size": 4},
    "tp4-ep4": {"tp_size": 4, "ep_size": 4},
    "tp4-ep4-masked": {"tp_size": 4, "ep_size": 4, "ep_plan": MASKED},
    "dp_replicate2-fsdp2-ep2": {"dp_replicate_size": 2, "fsdp_size": 2, "ep_size": 2},
    "tp2-fsdp2": {"tp_size": 2, "fsdp_size": 2},
    "tp4-fsdp2-ep4": {"tp_size": 4, "fsdp_size": 2, "ep_size": 4},
    "fsdp4": {"fsdp_size": 4},
    "dp_replicate2-fsdp2": {"dp_replicate_size": 2, "fsdp_size": 2},
    "dp_replicate2-tp2": {"dp_replicate_size": 2, "tp_size": 2},
    "fsdp2-ep2-plan-override": {"fsdp_size": 2, "ep_size": 2, "fsdp_plan": {"model.layers.*": "keep_full_weight"}},
    "cp2-fsdp2": {"cp_size": 2, "fsdp_size": 2},
    "pp2-fsdp2": {"pp_size": 2, "fsdp_size": 2},
}
# Uneven shards on the world of 4 the other layouts use (a world of 3 started for one case was ~10 s of 2 cores):
# 6 experts over fsdp 4 are torch.chunk's 2, 2, 2 and 0 rows; the tied head and the dense layers ride along.
UNEVEN = "moe_e6_k1_gqa3_tied_step2"
FAMILY_LAYOUTS = {
    UNEVEN: ["fsdp4"],
    "gptoss_e4_k3_gqa2_window5": ["single", "tp2-fsdp2", "fsdp4-ep4", "tp2-fsdp2-ep2"],
    "deepseekv3_e8_k3_groups_qlora_yarn": ["single", "tp2-fsdp2", "fsdp4-ep4", "tp4-ep4-masked"],
}
CASES = [(MOE, name) for name in QWEN3_LAYOUTS] + [(f, name) for f, names in FAMILY_LAYOUTS.items() for name in names]


def after_backward(ctx, ids: torch.Tensor):
    """Rank function: one backward (the gradients a step holds before its update), what the rank holds then, and
    the gradients cleared again."""
    loaded = ctx.require_model()
    training = loaded.require_training()
    batch = [MicroBatch(ids, ids.clone(), torch.ones_like(ids, dtype=torch.bool))]
    loaded.runner.backward(ctx, training, batch, float(ids.numel()), None)
    held = held_memory(ctx)
    training.optimizer.zero_grad(set_to_none=True)
    return held


def check_plan_equals_ranks(directory, layout, load, **options):
    config = DistributedConfig(**layout)
    planned = plan(
        directory, gpus=config.world_size, gpu_memory="80GB", layouts=[config], all_ranks=True, **options
    ).layouts[0]
    model = load(directory, layout, **options)
    try:
        model.configure_training(lr=1e-3)
        model.train_step(torch.randint(0, 64, (ROWS, SEQ)))  # AdamW makes its states at the first step
        ids = torch.randint(0, 64, (ROWS, SEQ), generator=torch.Generator().manual_seed(1))
        measured = model.run_on_ranks(after_backward, ids)
    finally:
        model.shutdown()
    assert [r.rank for r in planned.ranks] == list(range(config.world_size))
    assert all(m.gradients > 0 and m.optimizer > 0 for m in measured)  # the measurement saw real tensors
    assert list(planned.ranks) == measured
    return planned


@pytest.mark.parametrize(("family", "layout"), CASES, ids=[f"{f}-{n}" for f, n in CASES])
def test_planned_bytes_equal_loaded_ranks(load_on_world, tiny_checkpoint, family, layout):
    layout_config = {**QWEN3_LAYOUTS[layout]}
    if "pp_size" in layout_config:
        layout_config["pp_schedule"] = "1f1b"
    check_plan_equals_ranks(tiny_checkpoint(family), layout_config, load_on_world)


def test_first_rank_of_each_stage_holds_the_most(tiny_checkpoint):
    """The default plans the first rank of each pipeline stage only; it is the largest of every rank's."""
    for layout in ({"fsdp_size": 3}, {"pp_size": 2, "fsdp_size": 2}, {"tp_size": 2, "fsdp_size": 2, "ep_size": 2}):
        config = DistributedConfig(**layout)
        every = plan(tiny_checkpoint(MOE), gpus=config.world_size, gpu_memory="80GB", layouts=[config], all_ranks=True)
        first = plan(tiny_checkpoint(MOE), gpus=config.world_size, gpu_memory="80GB", layouts=[config])
        assert first.layouts[0].largest == every.layouts[0].largest


def test_lora_plan_equals_loaded_ranks(load_on_world, tiny_checkpoint):
    """A LoRA model: the frozen base in the compute dtype, gradients and AdamW only for the factors."""
    planned = check_plan_equals_ranks(
        tiny_checkpoint(MOE), {"tp_size": 2, "fsdp_size": 2, "ep_size": 2}, load_on_world, lora=LORA
    )
    whole = plan(tiny_checkpoint(MOE), gpus=4, gpu_memory="80GB", layouts=[DistributedConfig(tp_size=2, fsdp_size=2,
                 ep_size=2)]).layouts[0]  # fmt: skip
    assert planned.largest.gradients < whole.largest.gradients / 5


def test_packed_mxfp4_plan_equals_loaded_ranks(load_on_world, gpt_oss_mxfp4_checkpoint):
    """gpt-oss with its MXFP4 experts kept packed under LoRA: the packed blocks and scales count as stored."""
    _, directory = gpt_oss_mxfp4_checkpoint
    check_plan_equals_ranks(
        directory, {"fsdp_size": 2, "ep_size": 2}, load_on_world, lora=LORA, quantized_experts="mxfp4"
    )


def test_planning_refuses_a_process_with_a_world(load_local, tiny_checkpoint):
    load_local(tiny_checkpoint(MOE))
    with pytest.raises(RuntimeError, match=r"without a torch\.distributed world"), fake_world(0, 2):
        pass


def test_describe_shows_what_each_rank_holds_as_planned(load_on_world, tiny_checkpoint):
    """``model.memory()`` / ``model.describe()``: the measured breakdown, the plan's numbers once a step ran (no
    gradients are held between steps; AdamW's states exist from the first step)."""
    layout = {"tp_size": 2, "fsdp_size": 2, "ep_size": 2}
    planned = plan(
        tiny_checkpoint(MOE), gpus=4, gpu_memory="80GB", layouts=[DistributedConfig(**layout)], all_ranks=True
    ).layouts[0]
    model = load_on_world(tiny_checkpoint(MOE), layout)
    try:
        before = model.memory()
        model.configure_training(lr=1e-3)
        model.train_step(torch.randint(0, 64, (ROWS, SEQ)))
        after, text = model.memory(), model.describe()
    finally:
        model.shutdown()
    assert [(m.parameters, m.trainable, m.gradients, m.optimizer) for m in before] == [
        (p.parameters, p.trainable, 0, 0) for p in planned.ranks
    ]
    assert [(m.parameters, m.gradients, m.optimizer) for m in after] == [
        (p.parameters, 0, p.optimizer) for p in planned.ranks
    ]
    assert "memory per rank (measured; GB)" in text and "ranks 0-3: parameters" in text
