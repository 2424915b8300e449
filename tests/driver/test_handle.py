"""raymoe.from_pretrained on a local Ray: one rank and data-parallel replicas against transformers in one process."""

import pytest
import torch

import raymoe

MOE = "moe_e5_k3_gqa2_dense_mid"
LR, WEIGHT_DECAY, STEPS = 1e-2, 0.1, 3
# Trained weights, norm-relative: the layout tests' bound (tests/rank/conftest.py, WEIGHT_RTOL, which says why). Here
# element 1528 of the first layer's experts.down_proj has a first-step gradient of 1.7e-8 (the tensor's median:
# 1.8e-4), at AdamW's eps, where the update turns the gradient's rounding into weight: it is the element where
# transformers itself trained in float32 ends farthest from float64 (3.6e-6), and compiled blocks (pytest
# --compiled-blocks), whose fused kernels round differently, leave it 2.2e-5 from the reference, 1.6e-5 of the
# tensor's norm (eager: 2.5e-6 of it). A parameter trained without weight decay would end 3e-3 away.
WEIGHT_RTOL = 2e-5


def batches(vocab, seed=0):
    """Three global batches of 4 rows with right padding of different lengths (uneven tokens per rank)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for step in range(STEPS):
        ids = torch.randint(0, vocab, (4, 12), generator=gen)
        mask = torch.ones_like(ids)
        for row, pad in enumerate([0, 5, 9, 2 + step]):
            if pad:
                mask[row, -pad:] = 0
        out.append((ids, mask))
    return out


def assert_close_rel(actual, expected, rel, what):
    """Relative error of the whole tensor: ||actual - expected|| / ||expected||."""
    err = (torch.linalg.vector_norm(actual - expected) / torch.linalg.vector_norm(expected).clamp_min(1e-12)).item()
    assert err <= rel, f"{what}: rel error {err:.2e} > {rel:.0e}"


@pytest.mark.parametrize(
    "config",
    [{}, {"dp_replicate_size": 2}],
    ids=["one_rank", "dp_replicate2"],
)
def test_logits_training_and_save_equal_one_process(
    load_on_world, tiny_checkpoint, load_hf_model, reference_training, config, tmp_path
):
    directory = tiny_checkpoint(MOE)
    hf_model = load_hf_model(directory)
    data = batches(hf_model.config.vocab_size)
    ref_losses, _, ref_model = reference_training(hf_model, data, LR, WEIGHT_DECAY)
    ids = data[0][0]

    with load_on_world(directory, config) as model:
        with torch.no_grad():
            expected_logits = hf_model(input_ids=ids).logits
        assert (model(ids) - expected_logits).abs().max().item() <= 1e-5

        model.configure_training(lr=LR, weight_decay=WEIGHT_DECAY, betas=(0.9, 0.999), max_grad_norm=None)
        metrics = [model.train_step(ids, attention_mask=mask) for ids, mask in data]
        for step, (got, want) in enumerate(zip(metrics, ref_losses, strict=True)):
            assert abs(got["loss"] - want) <= 1e-5 * abs(want), (step, got["loss"], want)
        assert metrics[0]["num_tokens"] == int((data[0][1][:, 1:] == 1).sum())
        assert metrics[0]["lr"] == LR and metrics[0]["grad_norm"] > 0

        files = model.save_pretrained(tmp_path / "out")
        assert [f.name for f in files] == ["model.safetensors"]
        trained = load_hf_model(tmp_path / "out")
        reference = dict(ref_model.named_parameters())
        for name, param in trained.named_parameters():
            assert_close_rel(param, reference[name].detach(), WEIGHT_RTOL, name)
        with torch.no_grad():
            assert (model(ids) - trained(input_ids=ids).logits).abs().max().item() <= 1e-5


def test_handle_surface_and_lifecycle(ray_session, ray_tables, tiny_checkpoint):
    directory = tiny_checkpoint(MOE)
    before = ray_tables.rank_actors()
    model = raymoe.from_pretrained(directory, distributed_config={"dp_replicate_size": 2})
    assert model.topology.world_size == 2
    assert model.fsdp_plan["model.layers.*"] == "free_full_weight"
    assert model.ep_plan["model.layers.*.mlp.experts"] == "ep_dispatch_experts"
    assert model.supports_tp_plan
    assert "DistributedModel(qwen3_moe" in repr(model) and "replica" in repr(model) and "running" in repr(model)
    with pytest.raises(RuntimeError, match="configure_training"):
        model.train_step(torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"training: lr=-1"):
        model.configure_training(lr=-1)
    with pytest.raises(ValueError, match=r"input_ids must be token ids in \[0, 96\), got values in \[0, 500\]"):
        model(torch.tensor([[0, 500], [1, 2]]))
    with pytest.raises(ValueError, match=r"input_ids must hold integer token ids"):
        model(torch.zeros(2, 3))
    assert model(torch.zeros(1, 3, dtype=torch.long)).shape == (1, 3, 96)  # inference: any number of rows
    model.configure_training()
    with pytest.raises(ValueError, match=r"has 1 rows but the layout has dp_size=2"):
        model.train_step(torch.zeros(1, 3, dtype=torch.long))  # training: a row per data-parallel rank
    with pytest.raises(ValueError, match="left padding"):
        model.train_step(torch.zeros(2, 3, dtype=torch.long), attention_mask=torch.tensor([[0, 1, 1], [1, 1, 1]]))
    with pytest.raises(ValueError, match=r"micro_batches=2 needs at least that many rows per data-parallel rank"):
        model.train_step(torch.zeros(2, 3, dtype=torch.long), micro_batches=2)
    with pytest.raises(ValueError, match=r"micro_batches must be an int >= 1, got 0"):
        model.train_step(torch.zeros(2, 3, dtype=torch.long), micro_batches=0)
    with pytest.raises(ValueError, match="no label tokens"):
        model.train_step(torch.zeros(2, 3, dtype=torch.long), labels=torch.full((2, 3), -100))
    assert model._lease.releases_at_exit  # the actors are also freed when the driver exits
    model.shutdown()
    model.shutdown()
    assert "shut down" in repr(model)
    with pytest.raises(RuntimeError, match="shut down"):
        model(torch.zeros(2, 3, dtype=torch.long))
    # a second load in the same session gets fresh actors
    with raymoe.from_pretrained(directory) as again:
        assert again(torch.zeros(1, 3, dtype=torch.long)).shape == (1, 3, 96)
    assert ray_tables.rank_actors() == before


@pytest.mark.parametrize(
    ("config", "error", "match"),
    [
        ({"tp_size": 2, "ep_size": 3}, ValueError, r"ep_size=3 must be a multiple of tp_size=2 \[CFG-3\]"),
        ({"pp_size": 4}, ValueError, r"4 pipeline stages, but the model has num_hidden_layers=3: every stage needs"),
        ({"fsdp_size": 4, "ep_size": 4}, ValueError, r"ep_size=4 must divide the model's num_experts=5 \[CFG-3\]"),
        ({"tp_size": 2, "tp_plan": {"lm_heda": "colwise"}}, ValueError, r"'lm_heda'; did you mean 'lm_head'"),
    ],
)
def test_bad_layouts_fail_on_the_driver_before_any_actor(
    ray_session, ray_tables, tiny_checkpoint, config, error, match
):
    before = ray_tables.rank_actors()
    with pytest.raises(error, match=match):
        raymoe.from_pretrained(tiny_checkpoint(MOE), distributed_config=config)
    assert ray_tables.rank_actors() == before


def test_missing_checkpoint_fails_on_the_driver(ray_session, tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        raymoe.from_pretrained(tmp_path / "absent")
    with pytest.raises(ValueError, match=r"no config\.json in .*is .* a model checkpoint"):
        raymoe.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="dtype='int8' is not supported"):
        raymoe.from_pretrained(tmp_path, dtype="int8")


def test_a_world_hosts_one_model_at_a_time_and_outlives_it(world, tiny_checkpoint):
    directory = tiny_checkpoint(MOE)
    ranks = world(2)
    ids = torch.randint(0, 96, (2, 6), generator=torch.Generator().manual_seed(0))
    first = raymoe.from_pretrained(directory, distributed_config={"fsdp_size": 2}, world=ranks)
    with pytest.raises(ValueError, match=r"already hosts qwen3_moe .*call its shutdown"):
        raymoe.from_pretrained(directory, distributed_config={"tp_size": 2}, world=ranks)
    logits = first(ids)
    first.shutdown()
    assert ranks.is_alive and not first.is_alive and "shut down" in repr(first)
    with pytest.raises(RuntimeError, match="this model was shut down"):  # refused on the driver, the world lives on
        first(ids)
    # The same ranks, regrouped for another layout: tensor parallelism instead of FSDP.
    with raymoe.from_pretrained(directory, distributed_config={"tp_size": 2}, world=ranks) as second:
        assert second.topology.config.tp_size == 2
        assert (second(ids) - logits).abs().max().item() <= 1e-5
    with pytest.raises(ValueError, match=r"world_size=2 must equal .* = 4 \[CFG-1\]"):
        raymoe.from_pretrained(directory, distributed_config={"fsdp_size": 4}, world=ranks)
    assert ranks.is_alive
