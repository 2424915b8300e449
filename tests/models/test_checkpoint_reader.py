"""CheckpointReader: fused parameters whole or by block, sharded checkpoints, one error for all problems."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from raymoe.checkpoint import CheckpointReader, load_model, open_checkpoint
from raymoe.models import build_model, load_model_config

MOE = "moe_e5_k3_gqa2_dense_mid"  # 5 experts, I=16, layer 1 dense
GATE_UP = "model.layers.0.mlp.experts.gate_up_proj"
DOWN = "model.layers.0.mlp.experts.down_proj"


def _reader(directory):
    return open_checkpoint(directory, build_model(load_model_config(directory)))


def _rewrite(directory, target, edit):
    """Copy a single-file checkpoint to ``target`` with ``edit(state_dict)`` applied."""
    target.mkdir()
    (target / "config.json").write_text((directory / "config.json").read_text())
    state = load_file(directory / "model.safetensors")
    edit(state)
    save_file(state, target / "model.safetensors", metadata={"format": "pt"})
    return target


@pytest.mark.parametrize(
    "index",
    [
        (slice(1, 4),),  # experts 1..3 (an EP shard)
        (slice(None), slice(4, 8)),  # gate rows 4..7 of every expert (half of a TP shard)
        (slice(None), slice(16 + 4, 16 + 8)),  # the matching up rows
        (slice(2, 5), slice(12, 20), slice(3, 11)),  # a block across the gate/up boundary
        (slice(-2, None), slice(None), slice(None, -30)),
        (slice(3, 3),),  # empty
    ],
)
def test_block_of_fused_experts_equals_slice_of_whole(tiny_checkpoint, index):
    with _reader(tiny_checkpoint(MOE)) as reader:
        whole = reader.read(GATE_UP)
        torch.testing.assert_close(reader.read(GATE_UP, index), whole[index], rtol=0, atol=0)


def test_fused_layout_is_gate_then_up_stacked_over_experts(tiny_checkpoint):
    directory = tiny_checkpoint(MOE)
    hub = load_file(directory / "model.safetensors")
    with _reader(directory) as reader:
        gate_up, down = reader.read(GATE_UP), reader.read(DOWN)
    assert gate_up.shape == (5, 32, 32) and down.shape == (5, 32, 16)
    for e in range(5):
        prefix = f"model.layers.0.mlp.experts.{e}"
        assert torch.equal(gate_up[e, :16], hub[f"{prefix}.gate_proj.weight"])
        assert torch.equal(gate_up[e, 16:], hub[f"{prefix}.up_proj.weight"])
        assert torch.equal(down[e], hub[f"{prefix}.down_proj.weight"])


def test_a_block_reads_only_the_overlapping_hub_tensors(tiny_checkpoint, monkeypatch):
    with _reader(tiny_checkpoint(MOE)) as reader:
        reads = []
        real_read = reader.files.read
        monkeypatch.setattr(
            reader.files, "read", lambda key, block: reads.append((key, block)) or real_read(key, block)
        )
        reader.read(GATE_UP, (slice(3, 5), slice(2, 6)))
    prefix = "model.layers.0.mlp.experts"
    assert reads == [
        (f"{prefix}.3.gate_proj.weight", ((2, 6), (0, 32))),
        (f"{prefix}.4.gate_proj.weight", ((2, 6), (0, 32))),
    ]


def test_sharded_checkpoint_with_index(tmp_path, make_hf_model, load_hf_model):
    make_hf_model(MOE).save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]) > 0
    assert len(list(tmp_path.glob("model-*-of-*.safetensors"))) > 2
    model, reference = load_model(tmp_path), load_hf_model(tmp_path)
    expected = reference.state_dict()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, expected[name]), name


def test_one_error_lists_every_problem(tiny_checkpoint, tmp_path):
    def break_it(state):
        del state["model.layers.0.mlp.experts.2.up_proj.weight"]
        del state["model.norm.weight"]
        state["model.extra.weight"] = torch.zeros(3)
        state["model.embed_tokens.weight"] = torch.zeros(97, 32)
        state["model.layers.0.self_attn.q_norm.weight"] = torch.zeros(8, dtype=torch.int32)
        state["model.layers.2.mlp.experts.1.down_proj.weight"] = torch.zeros(32, 15)
        state["model.layers.2.mlp.experts.3.gate_proj.weight"] = state[
            "model.layers.2.mlp.experts.3.gate_proj.weight"
        ].bfloat16()

    directory = _rewrite(tiny_checkpoint(MOE), tmp_path / "broken", break_it)
    with pytest.raises(ValueError) as info:
        load_model(directory)
    message = str(info.value)
    assert "does not match Qwen3MoeForCausalLM" in message
    assert "missing (2): model.layers.0.mlp.experts.2.up_proj.weight, model.norm.weight" in message
    assert "unexpected (1): model.extra.weight" in message
    assert "model.embed_tokens.weight: checkpoint (97, 32), model (96, 32)" in message
    assert "model.layers.2.mlp.experts.down_proj: stacked parts differ in shape" in message
    assert "model.layers.0.self_attn.q_norm.weight: I32" in message
    assert "model.layers.2.mlp.experts.gate_up_proj: parts stored in different dtypes ['BF16', 'F32']" in message


def test_tied_checkpoint_may_carry_the_head(tiny_checkpoint, tmp_path):
    source = tiny_checkpoint("qwen3_gqa4_tied")

    def add_head(state):
        state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()

    model = load_model(_rewrite(source, tmp_path / "with_head", add_head))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, load_model(source).model.embed_tokens.weight)


def test_untied_checkpoint_needs_the_head(tiny_checkpoint, tmp_path):
    directory = _rewrite(tiny_checkpoint(MOE), tmp_path / "no_head", lambda state: state.pop("lm_head.weight"))
    with pytest.raises(ValueError, match=r"missing \(1\): lm_head.weight"):
        load_model(directory)


def test_dtype_is_the_checkpoints_unless_requested(tiny_checkpoint, tmp_path, make_hf_model):
    assert load_model(tiny_checkpoint(MOE), dtype=torch.bfloat16).lm_head.weight.dtype == torch.bfloat16
    make_hf_model(MOE).to(torch.bfloat16).save_pretrained(tmp_path)
    model = load_model(tmp_path)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert not any(p.is_meta for p in model.parameters())


def test_bad_directories_and_indexes(tmp_path, tiny_checkpoint):
    layout = {"x": "x"}
    with pytest.raises(ValueError, match=r"no model\.safetensors or model\.safetensors\.index\.json"):
        CheckpointReader(tmp_path, layout)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "model-1.safetensors"}}))
    with pytest.raises(ValueError, match=r"lists shard files that are not in .*\['model-1.safetensors'\]"):
        CheckpointReader(tmp_path, layout)
    with _reader(tiny_checkpoint(MOE)) as reader:
        with pytest.raises(ValueError, match="expected a slice with step 1"):
            reader.read(GATE_UP, (slice(0, 4, 2),))
        with pytest.raises(ValueError, match="has 4 slices but the parameter has 3 dims"):
            reader.read(GATE_UP, (slice(None),) * 4)
        with pytest.raises(ValueError, match="'nope' is not a parameter"):
            reader.read("nope")
