"""apply_rules on a rank: which parameters get which style, meta placeholders, tied weights, errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

H, INTER, VOCAB = 8, 12, 16


class Lm(nn.Module):
    """Embedding -> MLP -> lm_head, optionally tied to the embedding."""

    def __init__(self, tied=False):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, H)
        self.up = nn.Linear(H, INTER)
        self.down = nn.Linear(INTER, H)
        self.lm_head = nn.Linear(H, VOCAB, bias=False)
        if tied:
            self.lm_head.weight = self.embed.weight

    def forward(self, ids):
        h = self.embed(ids)
        return self.lm_head(h + self.down(torch.relu(self.up(h))))


RULES = {"embed": "embedding_rowwise", "up": "colwise", "down": "rowwise", "lm_head": "colwise_gather_output"}
IDS = torch.tensor([[1, 5, 9, 15, 0, 7]])


def check_meta_model_then_load_through_the_bridge(rank):
    """The sharded-loader path: placeholders on meta, each filled by reading only this rank's blocks."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from raymoe.parallel.apply import apply_rules
    from raymoe.parallel.sharding import read_local_shard, shard_layout, with_local_shard

    torch.manual_seed(0)
    full = Lm()
    with torch.device("meta"):
        model = Lm()
    apply_rules(model, RULES, rank.mesh)
    expected = {
        "embed.weight": Shard(0),
        "up.weight": Shard(0),
        "up.bias": Shard(0),
        "down.weight": Shard(1),
        "down.bias": Replicate(),
        "lm_head.weight": Shard(0),
    }
    checkpoint = full.state_dict()
    reads = []
    for name, placeholder in list(model.named_parameters()):
        assert isinstance(placeholder, DTensor) and placeholder.device.type == "meta", name
        assert placeholder.placements == (expected[name],), (name, placeholder.placements)
        assert placeholder.to_local().shape == shard_layout(placeholder).local_shape

        def read(block, name=name):
            reads.append((name, block))
            return checkpoint[name][block]

        local = read_local_shard(placeholder, read)
        owner, _, leaf = name.rpartition(".")
        model.get_submodule(owner).register_parameter(leaf, nn.Parameter(with_local_shard(placeholder, local)))
    # only this rank's rows of the vocab-sharded embedding were read
    (embed_block,) = [block for name, block in reads if name == "embed.weight"]
    half = VOCAB // rank.world_size
    assert embed_block[0] == slice(rank.rank * half, (rank.rank + 1) * half)
    rank.expect_close("logits", model(IDS), full(IDS))


def check_parameter_rule_beats_module_rule(rank):
    from torch.distributed.tensor import Replicate, Shard

    from raymoe.parallel.apply import apply_rules

    model = nn.Sequential(nn.Linear(H, INTER))
    apply_rules(model, {"0.bias": "rowwise", "0": "colwise"}, rank.mesh)  # order does not matter
    assert model[0].weight.placements == (Shard(0),)
    assert model[0].bias.placements == (Replicate(),)


def check_tied_weights_stay_tied(rank):
    torch.manual_seed(0)
    full = Lm(tied=True)
    model = rank.sharded_twin(full, RULES)
    assert model.lm_head.weight is model.embed.weight
    assert len(list(model.parameters())) == len(list(full.parameters()))
    rank.expect_close("logits", model(IDS), full(IDS))
    (model(IDS) ** 2).mean().backward()
    (full(IDS) ** 2).mean().backward()
    rank.expect_same_grads(model, full)


def check_tied_weights_need_one_layout(rank):
    with pytest.raises(
        ValueError, match=r"lm_head.weight is tied to a parameter already sharded as \(Shard\(dim=1\),\)"
    ):
        rank.sharded_twin(Lm(tied=True), {"embed": "embedding_colwise", "lm_head": "colwise"})


def check_errors(rank):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from raymoe.parallel.apply import apply_rules

    with pytest.raises(ValueError, match=r"rule 'mlp.up' names no module or parameter of Lm"):
        apply_rules(Lm(), {"mlp.up": "colwise"}, rank.mesh)
    with pytest.raises(ValueError, match="unknown style 'colwize'"):
        apply_rules(Lm(), {"up": "colwize"}, rank.mesh)
    mesh_2d = init_device_mesh("cpu", (1, rank.world_size), mesh_dim_names=("fsdp", "tp"))
    with pytest.raises(ValueError, match="needs a 1-D mesh"):
        apply_rules(Lm(), {"up": "colwise"}, mesh_2d)
    odd = Lm()
    odd.up = nn.Linear(H, 3)
    with pytest.raises(ValueError, match=r"rule 'up.weight' -> 'colwise': weight \(3, 8\): dim 0 has size 3"):
        apply_rules(odd, {"embed": "embedding_rowwise", "up": "colwise"}, rank.mesh)
    assert not any(isinstance(p, DTensor) for p in odd.parameters())  # nothing half-applied
    model = Lm()
    apply_rules(model, {"up": "colwise", "down": "all_reduce"}, rank.mesh)
    with pytest.raises(ValueError, match=r"up.weight is already a DTensor"):
        apply_rules(model, {"up": "colwise"}, rank.mesh)
    with pytest.raises(ValueError, match=r"down already runs AllReduceParallel"):
        apply_rules(model, {"down": "all_reduce"}, rank.mesh)


def check_forward_exception_restores_parameters(rank):
    """A forward that raises leaves the DTensor parameters in place (the local swap is undone)."""
    from torch.distributed.tensor import DTensor

    model = rank.sharded_twin(nn.Sequential(nn.Linear(H, INTER)), {"0": "colwise"})
    with pytest.raises(RuntimeError):
        model(torch.randn(3, H + 1))
    assert isinstance(model[0].weight, DTensor) and isinstance(model[0].weight, nn.Parameter)


def test_meta_model_then_load_through_the_bridge(tp2):
    tp2.run(check_meta_model_then_load_through_the_bridge)


def test_parameter_rule_beats_module_rule(tp2):
    tp2.run(check_parameter_rule_beats_module_rule)


def test_tied_weights_stay_tied(tp2):
    tp2.run(check_tied_weights_stay_tied)


def test_tied_weights_need_one_layout(tp2):
    tp2.run(check_tied_weights_need_one_layout)


def test_errors(tp2):
    tp2.run(check_errors)


def test_forward_exception_restores_parameters(tp2):
    tp2.run(check_forward_exception_restores_parameters)
