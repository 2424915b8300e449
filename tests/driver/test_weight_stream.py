"""Weight streaming to a rollout engine (issue 31): ``iter_hub_weights`` and ``push_weights``.

The reference is ``save_pretrained``: the streamed buckets hold exactly its files' tensors (names, dtypes, values),
on one rank and on 4-rank layouts (tp x fsdp, expert parallelism, a pipeline), with LoRA merged and MXFP4 experts
dequantized. ``push_weights`` sends them to Ray actors holding a transformers model of the same config with other
random weights; afterwards their logits are raymoe's.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch
from ray import cloudpickle
from safetensors.torch import load_file

from raymoe import LoraConfig
from raymoe.driver import weight_stream

cloudpickle.register_pickle_by_value(sys.modules[__name__])

QWEN = "moe_e8_k2_mha"
GPT_OSS = "gptoss_e4_k3_gqa2_window5"
DEEPSEEK = "deepseekv3_e8_k3_groups_qlora_yarn"
LAYOUTS = {
    "tp2-fsdp2": {"tp_size": 2, "fsdp_size": 2},
    "tp2-fsdp2-ep2": {"tp_size": 2, "fsdp_size": 2, "ep_size": 2},
    "fsdp4-ep4": {"fsdp_size": 4, "ep_size": 4},
    "pp2": {"pp_size": 2},
    "pp2-fsdp2": {"pp_size": 2, "fsdp_size": 2},
}
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
LORA = LoraConfig(
    r=4, lora_alpha=8, target_modules=["q_proj", "o_proj"], target_parameters=EXPERTS, init_lora_weights=False
)
SMALL = 3000  # bytes: a few tensors per bucket of the tiny models, some tensors larger than a bucket
FLOAT32_KEPT = ("e_score_correction_bias",)  # a router's selection bias stays float32 (as save_pretrained keeps it)


def saved(model, directory: Path) -> dict[str, torch.Tensor]:
    model.save_pretrained(directory)
    return {key: value for file in sorted(directory.glob("*.safetensors")) for key, value in load_file(file).items()}


def streamed(model, **kwargs) -> list[list[tuple[str, torch.Tensor]]]:
    return list(model.iter_hub_weights(**kwargs))


def assert_same(buckets, expected: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> None:
    """The buckets hold every tensor of ``expected`` once, in full on the CPU, equal (in ``dtype`` when given)."""
    names = [name for bucket in buckets for name, _ in bucket]
    assert len(names) == len(set(names)) and set(names) == set(expected)
    for bucket in buckets:
        for name, tensor in bucket:
            want = expected[name]
            if dtype is not None and not name.endswith(FLOAT32_KEPT):
                want = want.to(dtype)
            assert tensor.device.type == "cpu" and tensor.is_contiguous(), name
            assert tensor.dtype == want.dtype and torch.equal(tensor, want), name


def assert_bucketed(buckets, bucket_bytes: int) -> None:
    """No bucket past ``bucket_bytes`` unless it is one tensor; each bucket closed only when full."""
    sizes = [[t.numel() * t.element_size() for _, t in bucket] for bucket in buckets]
    for index, bucket in enumerate(sizes):
        assert sum(bucket) <= bucket_bytes or len(bucket) == 1, (index, bucket)
        if index + 1 < len(sizes):  # closed: full, or the next tensor would not fit
            assert sum(bucket) >= bucket_bytes or sum(bucket) + sizes[index + 1][0] > bucket_bytes, (index, bucket)


def batch(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 96, (4, 8), generator=torch.Generator().manual_seed(seed))  # a row per dp rank


# --- one rank ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", [QWEN, GPT_OSS, DEEPSEEK])
def test_one_rank_streams_what_save_pretrained_writes(name, load_local, tiny_checkpoint, tmp_path):
    with load_local(tiny_checkpoint(name)) as model:
        expected = saved(model, tmp_path / "saved")
        whole = streamed(model)
        assert len(whole) == 1  # the default 512 MiB bucket holds the tiny model
        assert_same(whole, expected)
        small = streamed(model, bucket_bytes=SMALL)
        assert len(small) > 10
        assert_same(small, expected)
        assert_bucketed(small, SMALL)
        assert [n for b in small for n, _ in b] == [n for b in whole for n, _ in b]  # save_pretrained's order
        assert_same(streamed(model, dtype=torch.bfloat16), expected, dtype=torch.bfloat16)
        assert all(len(bucket) == 1 for bucket in streamed(model, bucket_bytes=1))


def test_closing_the_iterator_early_ends_the_stream_on_the_ranks(load_local, tiny_checkpoint, tmp_path):
    with load_local(tiny_checkpoint(QWEN)) as model:
        expected = saved(model, tmp_path / "saved")
        before = model(batch())
        stream = model.iter_hub_weights(bucket_bytes=SMALL)
        first = next(stream)
        assert model.run_on_ranks(_has_stream) == [True]
        assert torch.equal(model(batch()), before)  # other calls run between buckets
        stream.close()
        assert model.run_on_ranks(_has_stream) == [False]
        assert_same(streamed(model, bucket_bytes=SMALL), expected)
        assert_same([first], {key: expected[key] for key, _ in first})

        older = model.iter_hub_weights(bucket_bytes=SMALL)
        next(older)
        newer = model.iter_hub_weights(bucket_bytes=SMALL)
        assert_same(list(newer), expected)
        with pytest.raises(RuntimeError, match="ended by a newer one"):
            next(older)
        assert model.run_on_ranks(_has_stream) == [False]


def _has_stream(ctx) -> bool:
    return ctx.require_model().weight_stream is not None


def test_lora_streams_the_merged_checkpoint_after_training(load_local, tiny_checkpoint, tmp_path):
    with load_local(tiny_checkpoint(QWEN), lora=LORA) as model:
        model.configure_training(lr=1e-2)
        model.train_step(batch(1))
        expected = saved(model, tmp_path / "merged")
        assert not any("lora_" in key for key in expected)
        assert_same(streamed(model, bucket_bytes=SMALL), expected)


def test_packed_mxfp4_experts_stream_dequantized(load_local, gpt_oss_mxfp4_checkpoint, tmp_path):
    _, quantized = gpt_oss_mxfp4_checkpoint
    lora = {
        "r": 4,
        "lora_alpha": 8,
        "target_modules": ["q_proj"],
        "target_parameters": EXPERTS,
        "init_lora_weights": False,
    }
    with load_local(quantized, lora=lora, quantized_experts="mxfp4") as model:
        model.configure_training(lr=1e-2)
        model.train_step(batch(1))
        expected = saved(model, tmp_path / "saved")
        assert any(key.endswith("experts.gate_up_proj") for key in expected)
        assert_same(streamed(model, bucket_bytes=SMALL), expected)


class _NoRanks:
    """A fan-out that fails any call: the checks come before any rank is asked."""

    def every_rank(self, fn, *args):
        raise AssertionError(f"{fn.__name__} reached the ranks")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"bucket_bytes": 0}, "bucket_bytes must be an int >= 1 .* got 0"),
        ({"bucket_bytes": True}, "bucket_bytes must be an int >= 1 .* got True"),
        ({"bucket_bytes": "1"}, "bucket_bytes must be an int >= 1 .* got '1'"),
        ({"bucket_bytes": 2.5}, "bucket_bytes must be an int >= 1 .* got 2.5"),
        ({"dtype": torch.int8}, "dtype must be a floating torch.dtype .* got torch.int8"),
        ({"dtype": "bfloat16"}, "dtype must be a floating torch.dtype .* got 'bfloat16'"),
    ],
)
def test_bad_options_fail_on_the_driver(kwargs, message):
    with pytest.raises(ValueError, match=message):
        weight_stream.iter_hub_weights(_NoRanks(), **kwargs)
    with pytest.raises(ValueError, match=message):
        weight_stream.push_weights(_NoRanks(), [object()], **kwargs)


@pytest.mark.parametrize(
    ("receivers", "method", "message"),
    [
        ([], "load_weights", "receivers is empty"),
        (object(), "load_weights", "receivers must be a sequence of Ray actor handles, got object"),
        ("abc", "load_weights", "receivers must be a sequence of Ray actor handles, got str"),
        ([object()], "", "method must be the name"),
        ([object()], "load_weights", re.escape("receivers [0] (of 1) have no method 'load_weights'")),
    ],
)
def test_bad_receivers_fail_on_the_driver(receivers, method, message):
    with pytest.raises(ValueError, match=message):
        weight_stream.push_weights(_NoRanks(), receivers, method)


def test_the_handle_checks_before_its_ranks(load_local, tiny_checkpoint):
    with load_local(tiny_checkpoint(QWEN)) as model:
        with pytest.raises(ValueError, match="bucket_bytes"):
            model.iter_hub_weights(bucket_bytes=0)
        with pytest.raises(ValueError, match="receivers is empty"):
            model.push_weights([])
        assert model.run_on_ranks(_has_stream) == [False]


# --- 4 ranks ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "layout"),
    [
        (QWEN, "tp2-fsdp2"),
        (QWEN, "fsdp4-ep4"),
        (QWEN, "pp2"),
        (GPT_OSS, "tp2-fsdp2-ep2"),
        (DEEPSEEK, "tp2-fsdp2-ep2"),
        (DEEPSEEK, "pp2-fsdp2"),
    ],
)
def test_layouts_stream_what_save_pretrained_writes(name, layout, load_on_world, tiny_checkpoint, tmp_path):
    with load_on_world(tiny_checkpoint(name), LAYOUTS[layout]) as model:
        model.configure_training(lr=1e-2)
        model.train_step(batch(1))  # every shard moved: a rank streaming stale or wrong blocks would show
        expected = saved(model, tmp_path / "saved")
        assert_same(streamed(model), expected)
        small = streamed(model, bucket_bytes=SMALL)
        assert_same(small, expected)
        assert_bucketed(small, SMALL)
        assert_same(streamed(model, bucket_bytes=SMALL, dtype=torch.bfloat16), expected, dtype=torch.bfloat16)


@pytest.mark.parametrize("layout", ["tp2-fsdp2-ep2", "pp2-fsdp2"])
def test_lora_layouts_stream_the_merged_checkpoint(layout, load_on_world, tiny_checkpoint, tmp_path):
    with load_on_world(tiny_checkpoint(QWEN), LAYOUTS[layout], lora=LORA) as model:
        model.configure_training(lr=1e-2)
        model.train_step(batch(1))
        expected = saved(model, tmp_path / "merged")
        assert_same(streamed(model, bucket_bytes=SMALL), expected)


# --- push_weights -----------------------------------------------------------------------------------------------

EXPERT_KEY = re.compile(r"(.+\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


class Receiver:
    """A rollout engine's stand-in: a transformers model of ``directory``'s config with its own random weights.

    ``load_weights`` copies each hub tensor into the model; per-expert hub tensors go into transformers' fused
    ``gate_up_proj [E, 2I, H]`` (gate first) and ``down_proj [E, H, I]``, as an engine's weight loader maps them.
    """

    def build(self, directory: str, seed: int, fail_on: int | None = None) -> None:
        """A fresh model of ``directory``'s config (random weights of ``seed``); ``fail_on``: buckets it applies
        before its ``load_weights`` raises."""
        import json

        import transformers

        torch.manual_seed(seed)
        config = json.loads((Path(directory) / "config.json").read_text())
        routed = any(key in config for key in ("num_experts", "num_local_experts", "n_routed_experts"))
        options = {"experts_implementation": "eager"} if routed else {}
        hf_config = transformers.AutoConfig.from_pretrained(directory)
        self.model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32, **options).eval()
        self.fail_on, self.calls, self.names = fail_on, 0, []

    def load_weights(self, bucket: list[tuple[str, torch.Tensor]]) -> int:
        self.calls += 1
        if self.fail_on is not None and self.calls > self.fail_on:
            raise ValueError(f"engine out of memory at bucket {self.calls - 1}")
        state = self.model.state_dict()
        with torch.no_grad():
            for name, tensor in bucket:
                found = EXPERT_KEY.fullmatch(name)
                if found is None:
                    state[name].copy_(tensor)
                else:
                    stem, expert, proj = found.group(1), int(found.group(2)), found.group(3)
                    if proj == "down_proj":
                        state[f"{stem}.down_proj"][expert].copy_(tensor)
                    else:
                        fused = state[f"{stem}.gate_up_proj"][expert]
                        half = fused.shape[0] // 2
                        (fused[:half] if proj == "gate_proj" else fused[half:]).copy_(tensor)
                self.names.append(name)
        return len(bucket)

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.model(input_ids=ids).logits

    def loaded(self) -> list[str]:
        return self.names


class Silent:
    """An actor without the receiver's method."""

    def apply(self, bucket) -> None:
        return None


@pytest.fixture(scope="module")
def receiver_actors(ray_session) -> list:
    """Two receiver actors for the module (each test builds their models afresh) and one without the method."""
    actors = [ray_session.remote(num_cpus=0.25)(Receiver).remote() for _ in range(2)]
    actors.append(ray_session.remote(num_cpus=0.25)(Silent).remote())
    yield actors
    for actor in actors:
        ray_session.kill(actor)


def receivers_of(ray, actors: list, directory: Path, count: int, fail_on: dict[int, int] | None = None) -> list:
    """``count`` receivers, each with a fresh model of ``directory``'s config and other random weights."""
    fail_on = fail_on or {}
    ray.get([actors[i].build.remote(str(directory), seed=100 + i, fail_on=fail_on.get(i)) for i in range(count)])
    return actors[:count]


@pytest.mark.parametrize(("name", "layout"), [(QWEN, "tp2-fsdp2-ep2"), (GPT_OSS, "pp2")])
def test_push_weights_gives_the_receivers_the_model(
    name, layout, load_on_world, tiny_checkpoint, ray_session, receiver_actors, tmp_path
):
    ray = ray_session
    directory = tiny_checkpoint(name)
    receivers = receivers_of(ray, receiver_actors, directory, 2)
    ids = batch(3)
    with load_on_world(directory, LAYOUTS[layout]) as model:
        model.configure_training(lr=1e-2)
        model.train_step(batch(1))
        expected = saved(model, tmp_path / "saved")
        logits = model(ids)
        assert (ray.get(receivers[0].logits.remote(ids)) - logits).abs().max().item() > 1e-2  # other weights at first
        report = model.push_weights(receivers, bucket_bytes=SMALL)
    assert report["buckets"] > 1
    assert report["tensors"] == len(expected) and report["receivers"] == 2 and report["seconds"] > 0
    assert report["bytes"] == sum(t.numel() * t.element_size() for t in expected.values())
    for receiver in receivers:
        assert sorted(ray.get(receiver.loaded.remote())) == sorted(expected)
        assert (ray.get(receiver.logits.remote(ids)) - logits).abs().max().item() <= 1e-5


def test_push_weights_refuses_a_receiver_without_the_method(
    load_on_world, tiny_checkpoint, ray_session, receiver_actors
):
    ray = ray_session
    directory = tiny_checkpoint(QWEN)
    good = receivers_of(ray, receiver_actors, directory, 1)[0]
    silent = receiver_actors[2]
    with load_on_world(directory, LAYOUTS["tp2-fsdp2"]) as model:
        with pytest.raises(ValueError, match=re.escape("receivers [1] (of 2) have no method 'load_weights'")):
            model.push_weights([good, silent])
        assert ray.get(good.loaded.remote()) == []  # nothing moved
        model.push_weights([silent], method="apply")  # the method is the caller's to name


def test_a_receiver_that_raises_is_one_error_and_the_model_stays(
    load_on_world, tiny_checkpoint, ray_session, receiver_actors
):
    ray = ray_session
    directory = tiny_checkpoint(QWEN)
    receivers = receivers_of(
        ray, receiver_actors, directory, 2, fail_on={1: 1}
    )  # receiver 1 takes one bucket, then raises
    with load_on_world(directory, LAYOUTS["pp2-fsdp2"]) as model:
        message = r"push_weights: receiver 1: load_weights\(bucket 1\) raised ValueError: engine out of memory"
        with pytest.raises(RuntimeError, match=message):
            model.push_weights(receivers, bucket_bytes=SMALL)
        assert model.is_alive
        ids = batch(3)
        logits = model(ids)
        report = model.push_weights(receivers[:1], bucket_bytes=SMALL)  # the ranks left no collective half-done
        assert report["buckets"] > 1
    assert (ray.get(receivers[0].logits.remote(ids)) - logits).abs().max().item() <= 1e-5
