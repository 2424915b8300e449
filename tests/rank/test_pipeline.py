"""Pipeline parallelism trains exactly like one process (issue 19): three AdamW steps on a tiny Qwen3-MoE and a
tiny dense Llama of 9 decoder layers (no pipeline size divides it) give transformers' losses and gradient norms;
the saved checkpoint gathers every stage, loads in transformers and gives the handle's logits and generation."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

MASKED = {"model.layers.*.mlp.gate": "ep_router", "model.layers.*.mlp.experts": "moe_tp_experts"}
LAYERS = 9

LAYOUTS = {
    "pp2": {"pp_size": 2},
    "pp2-gpipe": {"pp_size": 2, "pp_schedule": "gpipe", "pp_microbatches": 4},
    "pp2-fsdp2": {"pp_size": 2, "fsdp_size": 2},
    "pp2-tp2": {"pp_size": 2, "tp_size": 2},
    "pp4-1f1b": {"pp_size": 4},
    "pp4-interleaved": {"pp_size": 4, "pp_schedule": "interleaved_1f1b"},
    "pp2-tp2-ep2-masked": {"pp_size": 2, "tp_size": 2, "ep_size": 2, "ep_plan": MASKED},
    "hsdp2-pp2": {"dp_replicate_size": 2, "pp_size": 2},  # replicas of a two-stage pipeline
}
DENSE_LAYOUTS = ["pp2", "pp2-fsdp2", "pp2-tp2", "pp4-1f1b", "pp4-interleaved"]


def _moe_config(transformers):
    return transformers.Qwen3MoeConfig(
        vocab_size=96,
        max_position_embeddings=256,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        mlp_only_layers=[4],
    )


def _llama_config(transformers):
    return transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        initializer_range=0.1,  # gradients of every layer well above AdamW eps (std 0.02 leaves deep ones near it)
    )


def _checkpoint(tmp_path_factory: pytest.TempPathFactory, make_config, name: str) -> Path:
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(make_config(transformers))
    with torch.no_grad():  # norms away from one, so loading them is tested too
        for param_name, param in model.named_parameters():
            if param_name.endswith("norm.weight"):
                param.add_(torch.randn_like(param) * 0.1)
    directory = tmp_path_factory.mktemp(name)
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    return _checkpoint(tmp_path_factory, _moe_config, "pp_moe")


@pytest.fixture(scope="module")
def llama_checkpoint(tmp_path_factory):
    return _checkpoint(tmp_path_factory, _llama_config, "pp_llama")


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_moe_pipeline_trains_like_one_process(check_layout, moe_checkpoint, tmp_path, layout):
    metrics = check_layout(LAYOUTS[layout], tmp_path, moe_checkpoint)
    assert all(m["grad_norm"] > 0 for m in metrics)


@pytest.mark.parametrize("layout", DENSE_LAYOUTS)
def test_dense_pipeline_trains_like_one_process(check_layout, llama_checkpoint, tmp_path, layout):
    check_layout(LAYOUTS[layout], tmp_path, llama_checkpoint)


def _ids(rows: int, seq: int = 10, seed: int = 0):
    import torch

    return torch.randint(0, 96, (rows, seq), generator=torch.Generator().manual_seed(seed))


def test_packed_rows_and_accumulation_equal_one_rank(load_on_world, moe_checkpoint):
    """document_ids reach every stage, and micro_batches > 1 accumulates over schedule steps: the same losses,
    gradient norms and evaluation as one rank."""
    import torch

    ids = _ids(8, 12)
    documents = torch.tensor([0] * 5 + [1] * 7).repeat(8, 1)
    results = {}
    for name, config in {"one": {}, "pp2": {"pp_size": 2, "pp_schedule": "gpipe"}}.items():
        with load_on_world(moe_checkpoint, config) as model:
            model.configure_training(lr=1e-3, max_grad_norm=1.0)
            steps = [model.train_step(ids, document_ids=documents, micro_batches=2) for _ in range(2)]
            evaluation = model.evaluate(ids, document_ids=documents)
            results[name] = ([(s["loss"], s["grad_norm"]) for s in steps], evaluation["loss"])
    (one_steps, one_eval), (pp_steps, pp_eval) = results["one"], results["pp2"]
    for (loss, norm), (want_loss, want_norm) in zip(pp_steps, one_steps, strict=True):
        assert loss == pytest.approx(want_loss, rel=1e-5) and norm == pytest.approx(want_norm, rel=1e-5)
    assert pp_eval == pytest.approx(one_eval, rel=1e-5)


def test_bad_pipeline_steps_fail_on_the_driver_and_change_nothing(load_on_world, moe_checkpoint):
    with load_on_world(moe_checkpoint, {"pp_size": 2, "pp_microbatches": 4}) as model:
        with pytest.raises(ValueError, match=r"balance .*not implemented under pipeline parallelism|load balancing"):
            model.configure_training(balance="aux")
        model.configure_training(lr=1e-3)
        with pytest.raises(
            ValueError,
            match=r"pp_microbatches=4 must divide the rows of every micro-batch a rank "
            r"runs: the global batch of 6 rows over dp_size=1 with micro_batches=1 gives micro-batches "
            r"of 6 rows",
        ):
            model.train_step(_ids(6))
        assert model.step == 0
        metrics = model.train_step(_ids(8))
        assert model.step == 1 and metrics["num_tokens"] == 8 * 9
        assert "expert_load" not in metrics  # no routing is recorded under pipelines (said in the docs)


def test_importing_raymoe_leaves_out_the_pipeline_runtime():
    """``torch.distributed.pipelining`` pulls in torch._dynamo (about 30 MiB, 0.3 s): only a rank running a pipeline
    imports it, so a driver's ``import raymoe`` does not."""
    modules = ("torch.distributed.pipelining", "torch._dynamo")
    script = f"import sys, raymoe; print([m for m in {modules!r} if m in sys.modules])"
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=Path(__file__).parents[2]
    )
    assert result.stdout.strip() == "[]", result.stdout
