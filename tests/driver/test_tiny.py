"""The embedded tiny Qwen3-MoE: a hub-layout checkpoint built locally, the global RNG left alone."""

import torch

import raymoe
from raymoe.driver.tiny import TINY_MOE_CONFIG
from raymoe.driver.tokenizer import load_tokenizer


def test_tiny_checkpoint_loads_and_leaves_the_global_rng_alone(tmp_path):
    torch.manual_seed(123)
    expected = torch.rand(1)
    torch.manual_seed(123)
    directory = raymoe.build_tiny_checkpoint(tmp_path / "tiny")
    assert torch.rand(1) == expected
    assert {p.name for p in directory.iterdir()} == {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    }
    model = raymoe.load_model(directory)
    assert model.num_experts == TINY_MOE_CONFIG["num_experts"] == 8
    ids = torch.tensor([load_tokenizer(directory).encode("hello")])
    assert model(ids).shape == (1, 5, 264)
    # same seed, same weights
    again = raymoe.load_model(raymoe.build_tiny_checkpoint(tmp_path / "again"))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters(), strict=True))
