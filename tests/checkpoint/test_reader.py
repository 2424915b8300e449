"""CheckpointReader: fused parameters whole or by block, sharded checkpoints, one error for all problems."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from raymoe.checkpoint import CheckpointReader, CheckpointWriter, load_model, open_checkpoint
from raymoe.models import build_model, load_model_config
from raymoe.models.common.hub_layout import Concat, Transpose, split_fused

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


@pytest.fixture
def transposed(tmp_path):
    """gpt-oss bf16 style: hub ``gate_up_proj [E, H, 2I]`` (x @ W) is the model's ``[E, 2I, H]``; and
    ``w [6, 4]`` is the transpose of ``a [4, 3]`` next to ``b [4, 3]``."""
    generator = torch.Generator().manual_seed(0)
    hub = {
        "experts.gate_up_proj": torch.randn(3, 8, 10, generator=generator),
        "a": torch.randn(4, 3, generator=generator),
        "b": torch.randn(4, 3, generator=generator),
    }
    save_file(hub, tmp_path / "model.safetensors")
    layout = {"gate_up": Transpose("experts.gate_up_proj"), "w": Transpose(Concat(("a", "b"), dim=1))}
    return tmp_path, layout, hub


@pytest.mark.parametrize(
    "index",
    [(), (slice(1, 3),), (slice(None), slice(2, 7)), (slice(0, 2), slice(3, 9), slice(1, 6)), (slice(1, 1),)],
)
def test_block_of_transposed_equals_slice_of_whole(transposed, index):
    directory, layout, hub = transposed
    with CheckpointReader(directory, layout) as reader:
        assert reader.shape("gate_up") == (3, 10, 8) and reader.dtype("gate_up") == torch.float32
        whole = reader.read("gate_up")
        assert torch.equal(whole, hub["experts.gate_up_proj"].transpose(1, 2))
        assert torch.equal(reader.read("gate_up", index), whole[index])
        assert torch.equal(reader.read("w"), torch.cat((hub["a"], hub["b"]), dim=1).T)
        assert torch.equal(reader.read("w", index[1:]), reader.read("w")[index[1:]])
        reader.check({"gate_up": (3, 10, 8), "w": (6, 4)}, "Toy")


def test_a_transposed_block_reads_the_swapped_block(transposed, monkeypatch):
    directory, layout, _ = transposed
    with CheckpointReader(directory, layout) as reader:
        reads = []
        real_read = reader.files.read
        monkeypatch.setattr(
            reader.files, "read", lambda key, block: reads.append((key, block)) or real_read(key, block)
        )
        reader.read("gate_up", (slice(1, 2), slice(2, 5), slice(0, 3)))
        assert reads == [("experts.gate_up_proj", ((1, 2), (0, 3), (2, 5)))]
        assert reader.bytes_read == 1 * 3 * 3 * 4  # float32
        reader.read("w", (slice(4, 6),))  # columns 1..2 of b only
        assert reads[1:] == [("b", ((0, 4), (1, 3)))]
        assert reader.bytes_read == 36 + 4 * 2 * 4


def test_transposed_round_trip_through_the_writer(transposed, tmp_path):
    directory, layout, hub = transposed
    with CheckpointReader(directory, layout) as reader:
        params = {name: reader.read(name) for name in layout}
    with CheckpointWriter(tmp_path / "saved", layout=layout) as writer:
        for name, tensor in params.items():
            writer.write_parameter(name, tensor)
    saved = load_file(tmp_path / "saved" / "model.safetensors")
    assert saved.keys() == hub.keys() and all(torch.equal(saved[key], hub[key]) for key in hub)
    with pytest.raises(ValueError, match=r"cannot transpose \(5,\) for 'x': needs 2 dims"):
        list(split_fused(Transpose("x"), torch.zeros(5)))
