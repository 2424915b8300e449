"""Pipeline stages on the driver (issue 19): the config's pipeline options, the stage split, and the bad inputs that
fail in prepare_launch, before any actor starts."""

from __future__ import annotations

import pytest

from raymoe import DistributedConfig
from raymoe.spec.launch import prepare_launch
from raymoe.spec.pipeline import StagePlan, balanced_starts

MOE = "moe_e8_k2_mha"  # 2 decoder layers, untied head
TIED = "moe_e6_k1_gqa3_tied_step2"  # 4 layers, tied head


@pytest.mark.parametrize(
    ("costs", "stages", "starts"),
    [
        ([1] * 5, 2, (0, 3)),  # the spare layer goes to the earlier stage
        ([1] * 9, 4, (0, 3, 5, 7)),
        ([1] * 8, 4, (0, 2, 4, 6)),
        ([1, 1, 10, 1, 1], 3, (0, 2, 3)),  # a heavy layer gets a stage of its own
        ([3, 1, 1, 1, 1, 1, 1, 1], 2, (0, 3)),  # balanced by size (5 | 5), not by count
        ([1, 1], 2, (0, 1)),
    ],
)
def test_layers_are_balanced_by_parameter_count(costs, stages, starts):
    assert balanced_starts(costs, stages) == starts


def test_stage_plan_maps_stages_to_layers_and_ranks():
    plan = StagePlan(
        num_layers=9, starts=(0, 2, 4, 6, 7, 8, 8, 8)[:4], pp_size=2, schedule="interleaved_1f1b", microbatches=2
    )
    assert [list(plan.layers(s)) for s in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7, 8]]
    assert plan.stages_of(0) == (0, 2) and plan.stages_of(1) == (1, 3)
    assert [plan.rank_of(s) for s in range(4)] == [0, 1, 0, 1]
    assert plan.describe().startswith("stage 0: layers 0-1 (pp rank 0); stage 1: layers 2-3 (pp rank 1)")


def test_pipeline_options_are_defaulted_and_checked():
    config = DistributedConfig(pp_size=4, fsdp_size=2)
    assert (config.pp_schedule, config.pp_microbatches, config.stages_per_rank, config.num_stages) == ("1f1b", 4, 1, 4)
    interleaved = DistributedConfig(pp_size=2, pp_schedule="interleaved_1f1b")
    assert (interleaved.stages_per_rank, interleaved.num_stages, interleaved.world_size) == (2, 4, 2)
    assert DistributedConfig.from_dict(interleaved.to_dict()) == interleaved
    for bad, words in [
        ({"pp_size": 4, "pp_microbatches": 2}, "pp_microbatches=2 must be at least pp_size=4"),
        (
            {"pp_size": 2, "pp_schedule": "interleaved_1f1b", "pp_microbatches": 3},
            "pp_microbatches=3 must be a multiple",
        ),
        ({"pp_size": 2, "pp_stages_per_rank": 2}, "pp_stages_per_rank=2 needs pp_schedule='interleaved_1f1b'"),
        ({"pp_size": 2, "pp_schedule": "interleaved_1f1b", "pp_stages_per_rank": 1}, "needs pp_stages_per_rank >= 2"),
        ({"pp_size": 2, "pp_split": [3, 5]}, r"pp_split=\[3, 5\] must list 1 increasing"),
        ({"pp_size": 2, "pp_split": [0]}, r"pp_split=\[0\] must list 1 increasing layer indices above 0"),
    ]:
        with pytest.raises(ValueError, match=rf"{words}.*\[CFG-10\]"):
            DistributedConfig(**bad)
    with pytest.raises(ValueError, match="pp_schedule"):
        DistributedConfig(pp_size=2, pp_schedule="zero_bubble")
    with pytest.warns(UserWarning, match=r"pipeline options \{'pp_microbatches': 4\} are ignored because pp_size=1"):
        assert DistributedConfig(pp_microbatches=4).num_stages == 1


def test_gpipe_takes_fewer_pieces_than_stages():
    assert DistributedConfig(pp_size=4, pp_schedule="gpipe", pp_microbatches=1).pp_microbatches == 1


def test_prepare_launch_plans_the_stages(tiny_checkpoint):
    spec = prepare_launch(tiny_checkpoint(MOE), {"pp_size": 2, "tp_size": 2})
    assert spec.stages is not None and spec.stages.starts == (0, 1) and spec.stages.num_stages == 2
    assert spec.topology.world_size == 4
    part = spec.build_meta_part(1)
    names = {name for name, _ in part.named_parameters()}
    assert "lm_head.weight" in names and "model.norm.weight" in names
    assert not any(name.startswith(("model.embed_tokens", "model.layers.0.")) for name in names)
    assert prepare_launch(tiny_checkpoint(MOE), {"fsdp_size": 2}).stages is None


@pytest.mark.parametrize(
    ("checkpoint", "config", "message"),
    [
        (
            MOE,
            {"pp_size": 4},
            r"pp_size=4 \* pp_stages_per_rank=1 = 4 pipeline stages, but the model has "
            r"num_hidden_layers=2: every stage needs at least one decoder layer \[CFG-10\]",
        ),
        (MOE, {"pp_size": 2, "pp_schedule": "interleaved_1f1b"}, r"= 4 pipeline stages, but the model has num_hidden_"),
        (
            MOE,
            {"pp_size": 2, "pp_split": [2]},
            r"pp_split=\[2\] starts a stage at layer 2, but the model has "
            r"num_hidden_layers=2",
        ),
        (TIED, {"pp_size": 2}, r"pp_size=2 with tie_word_embeddings=True is not supported yet"),
        # ep_size > tp_size selects token dispatch from the model's default plan
        (
            MOE,
            {"pp_size": 2, "fsdp_size": 2, "ep_size": 2},
            r"token dispatch .* cannot be combined with pp_size=2 "
            r"\[CFG-5\]",
        ),
    ],
)
def test_bad_pipelines_fail_on_the_driver(tiny_checkpoint, checkpoint, config, message):
    with pytest.raises(ValueError, match=message):
        prepare_launch(tiny_checkpoint(checkpoint), config)
