"""Load balancing on the ranks (SPEC LB-2), through the handle: the auxiliary loss of the global batch equals
transformers in one process under every layout; gradient accumulation follows its documented semantics;
bias balancing moves the same biases on every rank and they survive a checkpoint; capacity drops the same
pairs under every layout."""

from __future__ import annotations

import sys

import pytest
import torch
from ray import cloudpickle

import raymoe
from raymoe.checkpoint import load_model
from raymoe.rank.balance import routers

cloudpickle.register_pickle_by_value(sys.modules[__name__])

MOE = "moe_e8_k2_mha"  # 8 experts, top-2: splits 4 ways on every axis
AUX_COEF = 0.1  # large enough that the aux loss shows in the total beyond the 1e-5 bar
LR, WEIGHT_DECAY, STEPS, ROWS, SEQ = 1e-3, 0.1, 3, 8, 10
TORCH_ADAMW = {"betas": (0.9, 0.999), "max_grad_norm": None}
MASKED = {"model.layers.*.mlp.gate": "ep_router", "model.layers.*.mlp.experts": "moe_tp_experts"}
AUX_LAYOUTS = {
    "one-rank": {},
    "fsdp4-ep2": {"fsdp_size": 4, "ep_size": 2},
    "tp2-fsdp2-ep2": {"tp_size": 2, "fsdp_size": 2, "ep_size": 2},
    "dp_replicate2-fsdp2-ep2": {"dp_replicate_size": 2, "fsdp_size": 2, "ep_size": 2},
    "tp4-ep4-masked": {"tp_size": 4, "ep_size": 4, "ep_plan": MASKED},
}


@pytest.fixture
def batches(padded_batches):
    """``batches(vocab, seed=0)``: right-padded global batches (padding is outside the aux statistics)."""
    return lambda vocab, seed=0: padded_batches(vocab, steps=STEPS, rows=ROWS, seq=SEQ, seed=seed)


@pytest.fixture(scope="module")
def aux_checkpoint(tmp_path_factory, make_hf_model):
    """The tiny Qwen3-MoE with the aux loss in its config, as a hub checkpoint would have it."""
    model = make_hf_model(MOE)
    model.config.output_router_logits = True
    model.config.router_aux_loss_coef = AUX_COEF
    directory = tmp_path_factory.mktemp("aux")
    model.save_pretrained(directory)
    return directory


def transformers_steps(hf_model, data, objective):
    """AdamW steps of transformers in one process; ``objective(model, ids, mask)`` -> (loss, aux)."""
    import copy

    model = copy.deepcopy(hf_model).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    results = []
    for ids, mask in data:
        loss, aux = objective(model, ids, mask)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        results.append((loss.item(), float(aux.detach()) if torch.is_tensor(aux) else float(aux)))
    return results


def whole_batch(model, ids, mask):
    out = model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
    return out.loss, out.aux_loss


@pytest.mark.parametrize("layout", list(AUX_LAYOUTS))
def test_aux_loss_of_the_global_batch_equals_transformers_in_one_process(
    layout, aux_checkpoint, load_hf_model, load_on_world, batches
):
    hf_model = load_hf_model(aux_checkpoint)
    data = batches(hf_model.config.vocab_size)
    reference = transformers_steps(hf_model, data, whole_batch)
    with load_on_world(aux_checkpoint, AUX_LAYOUTS[layout]) as model:
        model.configure_training(lr=LR, weight_decay=WEIGHT_DECAY, **TORCH_ADAMW)
        assert model.balance.aux_loss_coef == AUX_COEF  # the checkpoint's convention (balance="auto")
        for step, ((ids, mask), (loss, aux)) in enumerate(zip(data, reference, strict=True)):
            metrics = model.train_step(ids, attention_mask=mask)
            assert abs(metrics["loss"] - loss) <= 1e-5 * loss, (step, metrics["loss"], loss)
            assert abs(metrics["aux_loss"] - aux) <= 1e-5 * aux, (step, metrics["aux_loss"], aux)
            assert metrics["loss"] == pytest.approx(metrics["lm_loss"] + AUX_COEF * metrics["aux_loss"], rel=1e-12)


def micro_batch_objective(micro_batches, dp_size):
    """The documented gradient-accumulation semantics, by hand: CE of the whole global batch, plus the mean over
    micro-batches of the aux loss of micro-batch i of every data-parallel rank together (rows of rank r:
    block r of the batch; its micro-batch i: block i of those)."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    def objective(model, ids, mask):
        out = model(
            input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100), output_router_logits=True
        )
        rows = torch.arange(ids.shape[0])
        per_rank = [torch.tensor_split(block, micro_batches) for block in torch.tensor_split(rows, dp_size)]
        auxes = []
        for i in range(micro_batches):
            chosen = torch.cat([blocks[i] for blocks in per_rank])
            token_rows = (chosen[:, None] * ids.shape[1] + torch.arange(ids.shape[1])).reshape(-1)
            logits = tuple(layer[token_rows] for layer in out.router_logits)
            auxes.append(load_balancing_loss_func(logits, 8, 2, mask[chosen]))
        aux = torch.stack(auxes).mean()
        lm_loss = out.loss - AUX_COEF * out.aux_loss  # transformers' CE of the whole batch
        return lm_loss + AUX_COEF * aux, aux.item()

    return objective


def test_gradient_accumulation_takes_each_micro_batch_aux_loss_over_all_ranks(
    aux_checkpoint, load_hf_model, load_on_world, batches
):
    hf_model = load_hf_model(aux_checkpoint)
    data = batches(hf_model.config.vocab_size, seed=1)
    reference = transformers_steps(hf_model, data, micro_batch_objective(micro_batches=2, dp_size=2))
    whole = transformers_steps(hf_model, data, whole_batch)
    assert abs(reference[0][1] - whole[0][1]) > 1e-4 * whole[0][1]  # the semantics differ from one big batch
    with load_on_world(aux_checkpoint, {"fsdp_size": 2}) as model:
        model.configure_training(lr=LR, weight_decay=WEIGHT_DECAY, **TORCH_ADAMW)
        for step, ((ids, mask), (loss, aux)) in enumerate(zip(data, reference, strict=True)):
            metrics = model.train_step(ids, attention_mask=mask, micro_batches=2)
            assert abs(metrics["loss"] - loss) <= 1e-5 * loss, (step, metrics["loss"], loss)
            assert abs(metrics["aux_loss"] - aux) <= 1e-5 * aux, (step, metrics["aux_loss"], aux)


def per_layer_objective(model, ids, mask):
    """CE of the whole batch plus the mean over layers of each layer's aux loss (transformers' function, one layer)."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    out = model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100), output_router_logits=True)
    aux = torch.stack([load_balancing_loss_func((layer,), 8, 2, mask) for layer in out.router_logits]).mean()
    return out.loss - AUX_COEF * out.aux_loss + AUX_COEF * aux, aux.item()


def test_the_per_layer_aux_loss_equals_its_hand_computation(aux_checkpoint, load_hf_model, load_on_world, batches):
    hf_model = load_hf_model(aux_checkpoint)
    data = batches(hf_model.config.vocab_size, seed=2)
    reference = transformers_steps(hf_model, data, per_layer_objective)
    with load_on_world(aux_checkpoint, {"tp_size": 2, "fsdp_size": 2, "ep_size": 2}) as model:
        model.configure_training(lr=LR, weight_decay=WEIGHT_DECAY, balance="layer_aux", **TORCH_ADAMW)
        assert model.balance.aux_loss_per_layer and model.balance.aux_loss_coef == AUX_COEF
        for step, ((ids, mask), (loss, aux)) in enumerate(zip(data, reference, strict=True)):
            metrics = model.train_step(ids, attention_mask=mask)
            assert abs(metrics["loss"] - loss) <= 1e-5 * loss, (step, metrics["loss"], loss)
            assert abs(metrics["aux_loss"] - aux) <= 1e-5 * aux, (step, metrics["aux_loss"], aux)


def test_a_run_can_switch_the_aux_loss_off_and_still_see_it(aux_checkpoint, load_on_world):
    ids = torch.randint(0, 96, (4, SEQ), generator=torch.Generator().manual_seed(2))
    with load_on_world(aux_checkpoint, {"fsdp_size": 2}) as model:
        model.configure_training(balance="none")
        metrics = model.train_step(ids)
    assert metrics["aux_loss_coef"] == 0.0 and metrics["aux_loss"] > 0  # telemetry without training on it
    assert metrics["loss"] == metrics["lm_loss"]
    assert len(metrics["dead_experts"]) == len(metrics["dropped_pairs"]) == 2  # one per MoE layer
    assert metrics["dropped_pairs"] == [0, 0]


# --- bias balancing, on a family whose routers carry e_score_correction_bias -----------------------------

BIASED = "glm4moe_e8_k3_shared2_qknorm"  # GLM-4.5: two sparse layers of 8 experts behind a dense first layer


def biases(ctx):
    """Every router's full selection bias on this rank."""
    out = []
    for router in routers(ctx.require_model().model):
        bias = router.e_score_correction_bias
        out.append(bias.full_tensor() if hasattr(bias, "full_tensor") else bias.detach().clone())
    return torch.stack(out).cpu()


def hub_biases(hf_model) -> torch.Tensor:
    """transformers' e_score_correction_bias buffers, one row per sparse layer."""
    return torch.stack(
        [buffer for name, buffer in hf_model.named_buffers() if name.endswith("e_score_correction_bias")]
    )


@pytest.fixture
def biased_world(world, tmp_path, make_hf_model):
    ranks = world(4)
    model = make_hf_model(BIASED)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.linspace(-0.01, 0.01, 8))
    model.save_pretrained(tmp_path / "biased")
    return ranks, tmp_path / "biased"


def test_bias_balancing_moves_the_same_biases_on_every_rank_and_they_survive_a_checkpoint(
    biased_world, tmp_path, load_hf_model
):
    """GLM-4.5's e_score_correction_bias is the tensor bias balancing moves; transformers reads the moved one."""
    ranks, directory = biased_world
    rate = 0.01
    start = torch.stack([torch.linspace(-0.01, 0.01, 8)] * 2)
    data = [torch.randint(0, 96, (4, SEQ), generator=torch.Generator().manual_seed(s)) for s in range(3)]
    finals = {}
    for layout in ({"fsdp_size": 4, "ep_size": 2}, {"tp_size": 2, "fsdp_size": 2, "ep_size": 2}):
        config = raymoe.DistributedConfig(**layout)
        with raymoe.from_pretrained(directory, distributed_config=config, world=ranks) as model:
            model.configure_training(balance="bias", bias_update_rate=rate)
            expected = start.clone()
            for ids in data:
                metrics = model.train_step(ids)
                load = torch.tensor(metrics["expert_load"], dtype=torch.float64)
                expected += rate * torch.sign(load.mean(dim=1, keepdim=True) - load)  # the rule, by hand
            on_ranks = model.run_on_ranks(biases)
            assert all(torch.equal(b, on_ranks[0]) for b in on_ranks)  # identical on every rank
            torch.testing.assert_close(on_ranks[0], expected.float(), atol=1e-7, rtol=0)
            assert not torch.equal(on_ranks[0], start)
            finals[str(layout)] = on_ranks[0]
            model.save_pretrained(tmp_path / "saved")
        # the saved checkpoint holds the moved biases: one process and a sharded reload both read them back
        single = load_model(tmp_path / "saved")
        torch.testing.assert_close(
            torch.stack([r.e_score_correction_bias.detach() for r in routers(single)]), finals[str(layout)]
        )
        assert torch.equal(hub_biases(load_hf_model(tmp_path / "saved")), finals[str(layout)])
        with raymoe.from_pretrained(tmp_path / "saved", distributed_config=config, world=ranks) as again:
            assert torch.equal(again.run_on_ranks(biases)[0], finals[str(layout)])
    first, second = finals.values()
    torch.testing.assert_close(first, second)  # the same routing decisions under both layouts


# --- capacity: the same pairs dropped under every layout -------------------------------------------------


@pytest.fixture(scope="module")
def skewed_checkpoint(tmp_path_factory, make_hf_model):
    """A router that sends most tokens to expert 0 (its row dominates), so a capacity of 1.0 drops pairs."""
    model = make_hf_model(MOE)
    with torch.no_grad():
        for layer in model.model.layers:
            gate = layer.mlp.gate.weight
            gate[0] = gate[0] + 4.0 * gate[1].abs().mean() * torch.sign(gate[0])
    directory = tmp_path_factory.mktemp("skewed")
    model.save_pretrained(directory)
    return directory


def hand_count(directory, ids, capacity_factor):
    """Dropped pairs per layer of one forward in one process: the rule applied by the router, then counted."""
    model = load_model(directory).train()
    for router in routers(model):
        router.capacity_factor = capacity_factor
        router.record = True
    with torch.no_grad():
        model(ids)
    return [int(router.last_routing.num_dropped) for router in routers(model)]


@pytest.mark.parametrize(
    "layout",
    [{"fsdp_size": 2, "ep_size": 2}, {"tp_size": 2, "fsdp_size": 2, "ep_size": 2}, {"fsdp_size": 4, "ep_size": 4}],
    ids=["fsdp2-ep2", "tp2-fsdp2-ep2", "fsdp4-ep4"],
)
def test_capacity_drops_the_same_pairs_under_every_dispatch_layout(layout, skewed_checkpoint, load_on_world):
    ids = torch.randint(0, 96, (4, SEQ), generator=torch.Generator().manual_seed(3))
    expected = hand_count(skewed_checkpoint, ids, 1.0)
    assert min(expected) > 0  # the skewed router does overflow
    results = {}
    for name, config in (("one rank", {}), ("layout", layout)):
        with load_on_world(skewed_checkpoint, config) as model:
            model.configure_training(capacity_factor=1.0, **TORCH_ADAMW)
            first = model.train_step(ids)
            second = model.train_step(ids)
        results[name] = (first, second)
    for first, _ in results.values():
        assert first["dropped_pairs"] == expected
    (one_a, one_b), (lay_a, lay_b) = results["one rank"], results["layout"]
    assert lay_a["loss"] == pytest.approx(one_a["loss"], rel=1e-5)
    assert lay_b["loss"] == pytest.approx(one_b["loss"], rel=1e-5)  # and the gradients of the dropped step agree
    assert lay_b["dropped_pairs"] == one_b["dropped_pairs"]
