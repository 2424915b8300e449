"""``raymoe.plan`` / ``raymoe plan`` (issue 34) on the driver: the step-growth estimate against the profiler's
measured growth of a real training step, the seed's Qwen3-30B-A3B rows, the candidates, the command line, and
every bad request refused with one clear error before anything is planned. (That the exact part equals what
loaded ranks hold: tests/rank/test_footprint.py.)"""

import json
from pathlib import Path

import pytest
import torch

from raymoe import plan
from raymoe.cli import main, parse_layout
from raymoe.driver.candidate_layouts import candidate_layouts, masked_ep_plan
from raymoe.driver.memory_plan import parse_memory
from raymoe.models.registry import build_model, parse_model_config
from raymoe.rank.contract import MicroBatch
from raymoe.rank.train import train_step
from raymoe.spec.config import DistributedConfig

CONFIGS = Path(__file__).parents[2] / "examples" / "configs"
QWEN3_30B = CONFIGS / "qwen3-30b-a3b"
GPT_OSS_120B = CONFIGS / "gpt-oss-120b"
MOE = "moe_e8_k2_mha"
MASKED = {"model.layers.*.mlp.gate": "ep_router", "model.layers.*.mlp.experts": "moe_tp_experts"}
# Wide enough that a step's memory is its activations, not fixed costs (the suite's tiny checkpoints have 40 hidden
# channels: there a few allocations of the allocator's own make up half the step's growth)
SHAPES = {"vocab_size": 512, "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
          "max_position_embeddings": 2048}  # fmt: skip
FAMILIES = {
    "qwen3_moe": lambda t: t.Qwen3MoeConfig(**SHAPES, num_key_value_heads=2, head_dim=64, intermediate_size=512,
                                           moe_intermediate_size=128, num_experts=8, num_experts_per_tok=2),
    "gpt_oss": lambda t: t.GptOssConfig(**SHAPES, num_key_value_heads=2, head_dim=64, intermediate_size=128,
                                        num_local_experts=8, num_experts_per_tok=2, sliding_window=128),
    "deepseek_v3": lambda t: t.DeepseekV3Config(**SHAPES, num_key_value_heads=4, intermediate_size=512,
                                                moe_intermediate_size=128, n_shared_experts=1, q_lora_rank=64,
                                                kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
                                                v_head_dim=32, n_routed_experts=8, num_experts_per_tok=2, n_group=1,
                                                topk_group=1, first_k_dense_replace=1),
}  # fmt: skip


@pytest.fixture(scope="module")
def wide_checkpoint(tmp_path_factory):
    """``wide_checkpoint(family)``: a random transformers checkpoint of :data:`SHAPES`, made once per module."""
    import transformers

    made = {}

    def get(family: str) -> Path:
        if family not in made:
            torch.manual_seed(0)
            made[family] = tmp_path_factory.mktemp(family)
            model = transformers.AutoModelForCausalLM.from_config(FAMILIES[family](transformers))
            model.save_pretrained(made[family])
        return made[family]

    return get


def step_growth(ctx, rows: int, seq: int, vocab: int, peak_of) -> int:
    """Rank function (a local world: ``peak_of`` is the conftest's, not pickled): the most CPU tensor bytes one
    training step holds at once beyond what was live before it."""
    ids = torch.randint(0, vocab, (rows, seq), generator=torch.Generator().manual_seed(seq))
    batch = [MicroBatch(ids, ids.clone(), torch.ones_like(ids, dtype=torch.bool))]
    return peak_of(lambda: train_step(ctx, batch, float(ids.numel())))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_step_growth_estimate_within_a_quarter_of_measured(load_local, wide_checkpoint, peak_of, family, checkpointing):
    """At three sequence lengths, the plan's step growth (gradients exact, activations estimated) is within 25 %
    of what a real step on one rank allocates beyond its weights and AdamW states (CPU, the profiler's count)."""
    directory, rows, lengths = wide_checkpoint(family), 2, (512, 768, 1024)
    layout = DistributedConfig(activation_checkpointing=checkpointing)
    planned = {
        seq: plan(directory, gpus=1, gpu_memory="80GB", seq_len=seq, batch=rows, layouts=[layout], device="cpu")
        for seq in lengths
    }
    model = load_local(directory, layout.to_dict())
    vocab = model.model_config.vocab_size
    model.configure_training(lr=1e-4)
    for seq in lengths:
        # the second step at a length: a first one after another length allocates more or less, by what the last
        # step left (under checkpointing); every later one the same as the second
        model.run_on_ranks(step_growth, rows, seq, vocab, peak_of)
        measured = model.run_on_ranks(step_growth, rows, seq, vocab, peak_of)[0]
        layout_plan = planned[seq].layouts[0]
        estimate = layout_plan.growth if checkpointing == "none" else layout_plan.growth_checkpointed
        assert 0.75 <= estimate / measured <= 1.25, (seq, estimate, measured)


def test_seed_rows_order_as_the_seed_measured():
    """The seed's Qwen3-30B-A3B table (8 x H100, bf16, seq 2048, masked EP with ep = tp): tp8 38.6 GB > tp4·fsdp2
    34.2 GB > tp2·fsdp4 32.3 GB. raymoe refuses tp8 (4 KV heads do not split 8 ways); the other two order as the
    seed's, with or without activation checkpointing, on the same global batch."""
    meta = build_model(parse_model_config(json.loads((QWEN3_30B / "config.json").read_text())), device="meta")
    texts = ("tp=8,ep=8,ep_mode=masking", "tp=4,fsdp=2,ep=4,ep_mode=masking", "tp=2,fsdp=4,ep=2,ep_mode=masking")
    rows = [parse_layout(text, meta) for text in texts]
    planned = plan(QWEN3_30B, gpus=8, gpu_memory="80GB", seq_len=2048, batch=8, precision="bf16-pure", layouts=rows)
    assert [name for name, _ in planned.refused] == ["tp8·ep8"]
    assert "k_proj" in planned.refused[0][1]
    tp4, tp2 = planned.find(tp_size=4), planned.find(tp_size=2)
    assert tp4.peak > tp2.peak and tp4.peak_checkpointed > tp2.peak_checkpointed
    assert tp4.largest.parameters > tp2.largest.parameters  # more FSDP shards hold less
    # bf16-pure full fine-tuning: 2 + 2 + 2 x 2 bytes a parameter, 30.5 B parameters over 8 ranks and a little more
    assert 30.5e9 * 8 / 8 < tp2.largest.states < 1.05 * 30.5e9 * 8 / 8


def test_gpt_oss_120b_lora_on_packed_experts_fits_one_h200():
    """LoRA on gpt-oss-120b's MXFP4 experts kept packed fits one 141 GB GPU; the experts dequantized do not."""
    packed = plan(GPT_OSS_120B, gpus=1, gpu_memory="141GB", seq_len=4096, lora={"r": 16, "target_modules": ["q_proj"],
                  "target_parameters": ["mlp.experts.gate_up_proj"]}, quantized_experts="mxfp4")  # fmt: skip
    plain = plan(GPT_OSS_120B, gpus=1, gpu_memory="141GB", seq_len=4096, lora={"r": 16, "target_modules": ["q_proj"]})
    assert packed.best is not None and packed.layouts[0].largest.parameters < 75e9
    assert plain.best is None and plain.layouts[0].largest.parameters > 200e9
    command = packed.command()
    assert command is not None and "--quantized-experts mxfp4" in command and "--lora-r 16" in command


def test_candidates_cover_the_mechanisms():
    config = parse_model_config(json.loads((QWEN3_30B / "config.json").read_text()))
    meta = build_model(config, device="meta")
    made = list(candidate_layouts(meta, 128, 8, 1))
    names = {(c.tp_size, c.fsdp_size, c.ep_size, mode) for c, mode in made}
    assert {(4, 2, 4, "masking"), (4, 2, 4, "dispatch"), (1, 8, 8, "dispatch"), (8, 1, 1, "none")} <= names
    across = [c for c, _ in candidate_layouts(meta, 128, 16, 2)]
    assert all((c.tp_size or 1) <= 8 for c in across) and any(c.dp_replicate_size == 2 for c in across)


def test_masked_plans_name_each_familys_router(tiny_checkpoint):
    """Masking's ep_plan comes from the model: gpt-oss's router is ``mlp.router``, Qwen3-MoE's ``mlp.gate``."""
    gpt_oss = build_model(parse_model_config(json.loads((GPT_OSS_120B / "config.json").read_text())), device="meta")
    qwen3 = build_model(parse_model_config(json.loads((QWEN3_30B / "config.json").read_text())), device="meta")
    assert masked_ep_plan(gpt_oss) == {"model.layers.*.mlp.router": "ep_router", "model.layers.*.mlp.experts":
                                       "moe_tp_experts"}  # fmt: skip
    assert masked_ep_plan(qwen3) == MASKED
    planned = plan(tiny_checkpoint("gptoss_e4_k3_gqa2_window5"), gpus=2, gpu_memory="80GB", seq_len=16)
    assert planned.refused == () and any(layout.expert_mode == "masking" for layout in planned.layouts)


def test_ranked_fitting_first_then_by_communication(tiny_checkpoint):
    planned = plan(tiny_checkpoint(MOE), gpus=4, gpu_memory="80GB", seq_len=64)
    assert planned.refused == () and len(planned.layouts) > 5
    volumes = [layout.communication.total for layout in planned.layouts]
    assert volumes == sorted(volumes)
    assert planned.best is planned.layouts[0]
    tight = plan(tiny_checkpoint(MOE), gpus=4, gpu_memory=planned.layouts[-1].peak_checkpointed, seq_len=64)
    assert [layout.fits or layout.fits_checkpointed for layout in tight.layouts] == sorted(
        (layout.fits or layout.fits_checkpointed for layout in tight.layouts), reverse=True
    )


def test_cli_prints_the_table_and_the_command(tiny_checkpoint, capsys):
    assert main(["plan", str(tiny_checkpoint(MOE)), "--gpus", "4", "--gpu-memory", "80GB", "--seq-len", "64"]) == 0
    out = capsys.readouterr().out
    assert "| layout | params |" in out and "best: python examples/finetune.py --model" in out
    # every size finetune.py defaults (tp2·fsdp2·ep2) is given, so the command launches the planned layout
    best = out.rpartition("best: ")[2]
    assert all(flag in best for flag in ("--tp-size", "--fsdp-size", "--ep-size"))
    assert (
        main(["plan", str(tiny_checkpoint(MOE)), "--gpus", "4", "--gpu-memory", "80GB", "--layout", "pp=2,fsdp=2"]) == 0
    )
    assert "raymoe.from_pretrained(" in capsys.readouterr().out.rpartition("best: ")[2]
    assert main(["plan", str(tiny_checkpoint(MOE)), "--gpus", "2", "--gpu-memory", "1GiB", "--json",
                 "--layout", "tp=2,ep=2,ep_mode=masking", "--lora-r", "4"]) == 0  # fmt: skip
    report = json.loads(capsys.readouterr().out)
    assert [layout["expert_mode"] for layout in report["layouts"]] == ["masking"]
    assert "--ep-mode masking" in report["command"] and "--lora-r 4" in report["command"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--gpus", "4", "--gpu-memory", "80XB"], "gpu_memory='80XB' must be a positive size"),
        (["--gpus", "0", "--gpu-memory", "80GB"], "gpus=0 must be an int >= 1"),
        (["--gpus", "6", "--gpu-memory", "80GB", "--nodes", "4"], "gpus=6 must be a multiple of nodes=4"),
        (["--gpus", "4", "--gpu-memory", "80GB", "--layout", "tp=2,fsdp=two"], "'fsdp=two' is not one of"),
        (["--gpus", "4", "--gpu-memory", "80GB", "--quantized-experts", "mxfp4"], "need --lora-r"),
        (["--gpus", "4", "--gpu-memory", "80GB", "--layout", "tp=3"], "no layout of 4 GPU(s) passes its checks"),
    ],
)
def test_cli_refuses_bad_requests_in_one_line(tiny_checkpoint, capsys, argv, message):
    assert main(["plan", str(tiny_checkpoint(MOE)), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("raymoe plan: error: ") and message in err and err.count("\n") == 1


def test_cli_refuses_a_missing_model(tmp_path, capsys):
    assert main(["plan", str(tmp_path / "nowhere"), "--gpus", "1", "--gpu-memory", "80GB"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_memory_sizes():
    assert parse_memory("80GB") == 80 * 10**9 and parse_memory("80 GiB") == 80 * 2**30 and parse_memory(1024) == 1024
    assert parse_memory("141") == 141 * 10**9
    for bad in ("", "-1GB", "0GB", "eighty", True):
        with pytest.raises(ValueError, match="gpu_memory"):
            parse_memory(bad)


def test_masked_layout_text():
    meta = build_model(parse_model_config(json.loads((QWEN3_30B / "config.json").read_text())), device="meta")
    layout = parse_layout("tp=2,fsdp=2,ep=2,ep_mode=masking", meta)
    assert (layout.tp_size, layout.fsdp_size, layout.ep_size, layout.ep_plan) == (2, 2, 2, MASKED)


def test_units_that_keep_their_weights_gather_once_and_hold_every_layer(tiny_checkpoint):
    """``fsdp_reshard_after_forward``: where every unit keeps its gathered weights (``auto`` on a device far larger
    than the model), the plan counts one all-gather a step instead of two and every unit's weights at the peak;
    ``auto`` on a device too small to keep them plans as ``always``."""

    def planned(choice: str, memory: str):
        layout = DistributedConfig(fsdp_size=4, fsdp_reshard_after_forward=choice)
        return plan(tiny_checkpoint(MOE), gpus=4, gpu_memory=memory, seq_len=64, layouts=[layout]).layouts[0]

    always, auto, never = planned("always", "80GB"), planned("auto", "80GB"), planned("never", "80GB")
    assert auto.communication == never.communication
    assert auto.communication.fsdp_all_gather == pytest.approx(always.communication.fsdp_all_gather / 2, abs=1)
    assert auto.communication.fsdp_reduce_scatter == always.communication.fsdp_reduce_scatter > 0
    assert auto.activations.gathered > always.activations.gathered > 0
    short = planned("auto", "1MB")
    assert short.communication == always.communication and short.activations == always.activations
