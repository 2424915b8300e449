"""Shared fixtures: one local Ray instance for the multi-rank tests, gloo process groups for the
style tests, and tiny random transformers checkpoints as the numerical reference.

``--import-mode=importlib`` keeps tests/ off sys.path, so helpers are fixtures, not imports.
"""

from __future__ import annotations

import atexit
import copy
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch._C._profiler import _EventType

# Tests never reach the network: hub code paths read local files only.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# Tokenized datasets (and `datasets`' Arrow files) are cached in a directory of this session, removed at exit,
# not in the user's ~/.cache.
if "RAYMOE_CACHE_DIR" not in os.environ:
    _CACHE = tempfile.mkdtemp(prefix="raymoe-test-cache-")
    atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
    os.environ["RAYMOE_CACHE_DIR"] = os.path.join(_CACHE, "tokenized")
    os.environ.setdefault("HF_DATASETS_CACHE", os.path.join(_CACHE, "datasets"))


_HANDED_OUT: set[int] = set()


def listen_port() -> int:
    """A port for a server a test starts later: free now, and outside the kernel's ephemeral range.

    A port from that range (a bind to port 0, then closed) is free only until the next connection anywhere on the
    machine takes it as its local end; the server that binds it seconds or minutes later (this session's moto, a
    Ray head's dashboard, GCS and agent) then fails to start. Outside the range, only a process that names the port
    takes it. Ray's worker ports (10002-19999 by default) are avoided too.
    """
    import secrets
    import socket

    linux_range = Path("/proc/sys/net/ipv4/ip_local_port_range")
    # elsewhere (macOS, BSD) the kernel hands out IANA's dynamic range
    low, high = (int(part) for part in linux_range.read_text().split()) if linux_range.exists() else (49152, 65535)
    candidates = [port for port in range(20000, 65536) if not low <= port <= high and port not in _HANDED_OUT]
    if not candidates:  # a kernel that hands out every port above 20000: the window stays, the tests still run
        candidates = [port for port in range(20000, 65536) if port not in _HANDED_OUT]
    # sessions run side by side (make test) choose from their own residue classes: two never hand out one port
    share, sessions = (int(part) for part in os.environ.get("RAYMOE_TEST_PORTS", "0/1").split("/"))
    candidates = [port for port in candidates if port % sessions == share]
    for _ in range(200):
        port = candidates[secrets.randbelow(len(candidates))]
        with socket.socket() as probe:
            try:
                probe.bind(("", port))
            except OSError:  # someone listens there (or a closed connection's TIME_WAIT holds it)
                continue
        _HANDED_OUT.add(port)
        return port
    raise RuntimeError(f"no free port among 200 tries in 20000-65535 (the ephemeral range is {low}-{high})")


@pytest.fixture(scope="session")
def listen_ports() -> Callable[[], int]:
    """:func:`listen_port`, for test modules (``--import-mode=importlib`` keeps conftest unimportable)."""
    return listen_port


# Storage URLs (s3://) go to a local S3-compatible server (moto) the `s3_bucket` fixture starts on this port; set
# before any Ray worker starts, so every rank process reaches it too, with the server's test credentials.
S3_PORT = listen_port()
os.environ.update(
    AWS_ENDPOINT_URL_S3=f"http://127.0.0.1:{S3_PORT}",
    AWS_ACCESS_KEY_ID="testing",
    AWS_SECRET_ACCESS_KEY="testing",
    AWS_DEFAULT_REGION="us-east-1",
)

# Ray Data reads a Parquet file's footers in a pool of 32 actors per read, however small the input: 32 processes
# started for one file (18 of the 20 s of test_ray_data's Parquet test). Two do it here; set before Ray starts, as
# the pool is made in a Ray task.
os.environ.setdefault("RAY_DATA_PARQUET_FOOTER_NUM_ACTORS", "2")
# Ray starts two idle Python workers when the first driver connects, for tasks; none of the session's Ray runs a task
# until test_ray_data, and rank actors get processes of their own. Idle, each wakes 100 times a second (0.008-0.012
# CPU-seconds a second; the two, ~15-20 CPU-seconds over a session). Set before Ray starts (the raylet reads it).
os.environ.setdefault("RAY_prestart_worker_first_driver", "0")

RAY_TEST_CPUS = 16  # logical CPUs: the shared worlds below plus 8-rank groups of their own, on 2 cores
WORLD_CPUS_PER_RANK = 0.25  # the shared worlds' 15 ranks hold 3.75 logical CPUs, leaving 12 for other groups


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test that uses Ray is marked ``ray`` (``make test-fast`` deselects them; ``make test`` runs them and the
    rest of the suite as two pytest sessions side by side). The modules marked ``world_of_8`` run as one block."""
    for item in items:
        if {"ray_session", "world"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.ray)
    items[:] = world_of_8_as_one_block(items)


def world_of_8_as_one_block(items: list[pytest.Item]) -> list[pytest.Item]:
    """``items`` with those of the modules marked ``world_of_8`` moved together, in their order, to where the last
    such module ran: the session's world of 8 ranks starts once (~35 CPU-seconds on 2 cores, 8 rank processes) and
    is shut down after the block (:func:`pytest_runtest_teardown`), instead of idling between its users or starting
    again for each (test_group in tests/actors, test_footprint and test_layouts in tests/rank)."""
    block = [item for item in items if item.get_closest_marker("world_of_8")]
    if not block:
        return items
    last_module = block[-1].path
    first_of_last = next(index for index, item in enumerate(items) if item.path == last_module)
    before = [item for item in items[:first_of_last] if not item.get_closest_marker("world_of_8")]
    after = [item for item in items[first_of_last:] if not item.get_closest_marker("world_of_8")]
    return before + block + after


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    """After the ``world_of_8`` block's last test (and its fixtures' teardown), the world of 8 ranks is shut down: no
    test asks for it again, and its idle ranks would cost CPU for the rest of the session."""
    result = yield
    leaves_block = nextitem is None or not nextitem.get_closest_marker("world_of_8")
    if item.get_closest_marker("world_of_8") and leaves_block and _SHARED_WORLDS:
        _SHARED_WORLDS[0].release(8)
    return result


@pytest.fixture(scope="session")
def ray_session():
    """A local Ray instance for the whole test session, without the dashboard: nothing reads it, and it costs CPU as
    the tests run (7-16 % of test_pipeline's and test_lora's; README, Development). What tests ask of the cluster:
    :class:`RayTables`."""
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=RAY_TEST_CPUS, log_to_driver=False, include_dashboard=False)
        # The log monitor only forwards workers' output to drivers, which log_to_driver=False turns off here; it still
        # globs and stats every worker's log file 10 times a second (~170 files by the session's end): ~50 CPU-seconds
        # a session. ray.init has no switch for it (`ray start` has --include-log-monitor).
        ray._private.worker._global_node.kill_log_monitor(check_alive=False)
    yield ray
    ray.shutdown()


class RayTables:
    """This session's Ray as its GCS lists it, for the tests that check which rank actors and placement groups are
    left or were started. Read over the driver's own connection: Ray's state API (``ray.util.state``) asks the
    dashboard, which the session's Ray runs without; and it is this session's cluster whatever else runs here."""

    def __init__(self, ray: Any) -> None:
        self._ray = ray

    def rank_actors(self, state: str | None = "ALIVE") -> set[str]:
        """Ids of the rank actors in ``state`` (``None``: in any, the dead ones too); the shared worlds' are among
        them once started."""
        table = self._ray._private.state.actors(actor_state_name=state).values()
        return {actor["ActorID"] for actor in table if actor["ActorClassName"] == "RankActor"}

    def live_placement_groups(self) -> set[str]:
        return {pg_id for pg_id, pg in self._ray.util.placement_group_table().items() if pg["state"] != "REMOVED"}


@pytest.fixture(scope="session")
def ray_tables(ray_session) -> RayTables:
    """The session's rank actors and placement groups (:class:`RayTables`)."""
    return RayTables(ray_session)


@pytest.fixture(scope="session")
def world(ray_session):
    """``world(n)``: a world of ``n`` rank actors (``raymoe.start_world``) shared by the whole session
    (``world.release(n)`` shuts it down before the session ends: :class:`SharedWorlds`).

    Tests that only need *a* model on *some* ranks load onto it (``from_pretrained(..., world=world(n))``)
    instead of starting actors of their own; each load sets its own layout, and the handle's
    ``shutdown`` unloads it. A world that a rank failure ended is started again on the next request.
    """
    shared = SharedWorlds()
    _SHARED_WORLDS.append(shared)
    yield shared
    _SHARED_WORLDS.remove(shared)
    shared.shutdown()


_SHARED_WORLDS: list[SharedWorlds] = []  # the session's, for pytest_runtest_teardown to release the world of 8


class SharedWorlds:
    """The ``world`` fixture: ``world(n)`` starts a world of ``n`` ranks the first time it is asked for (or after a
    rank failure ended it) and hands the same one out after that; ``release(n)`` shuts it down early.

    An idle rank is not free (~0.6-0.9 CPU-seconds a minute: Ray's core worker and each gloo group wake 100 times a
    second), so a module whose world no test asks for again for a long while releases it: a start (~5.5 CPU-seconds
    a rank) costs less than ~10 idle minutes."""

    def __init__(self) -> None:
        self._worlds: dict[int, Any] = {}

    def __call__(self, size: int) -> Any:
        import raymoe

        if size not in self._worlds or not self._worlds[size].is_alive:
            self._worlds[size] = raymoe.start_world(size, cpus_per_rank=WORLD_CPUS_PER_RANK, collective_timeout_s=300)
        return self._worlds[size]

    def release(self, size: int) -> None:
        started = self._worlds.pop(size, None)
        if started is not None:
            started.shutdown()

    def shutdown(self) -> None:
        for size in list(self._worlds):
            self.release(size)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--compiled-blocks",
        action="store_true",
        help="load_on_world loads with compile=True unless a test says otherwise: every layout test on compiled "
        "decoder blocks (on CPU the default is eager; slow: each new graph compiles in C++)",
    )


@pytest.fixture(scope="session")
def load_on_world(world, pytestconfig):
    """``load_on_world(checkpoint, config_dict, **kwargs)``: ``from_pretrained`` onto the shared world of that size
    (with ``compile=True`` by default under ``pytest --compiled-blocks``)."""
    import raymoe
    from raymoe import DistributedConfig

    compiled = pytestconfig.getoption("--compiled-blocks")

    def load(checkpoint, config=None, **kwargs):
        layout = DistributedConfig(**(config or {}))
        if compiled:
            kwargs.setdefault("compile", True)
        return raymoe.from_pretrained(checkpoint, distributed_config=layout, world=world(layout.world_size), **kwargs)

    return load


@pytest.fixture
def load_local():
    """``load_local(checkpoint, config_dict, **kwargs)``: ``from_pretrained`` onto a ``LocalRankGroup`` (one rank in
    the test's own process, no Ray: the handle's and the Trainer's logic under ``make test-fast``); the world ends
    with the test."""
    import raymoe
    from raymoe import DistributedConfig
    from raymoe.rank.local import LocalRankGroup

    worlds = []

    def load(checkpoint, config=None, **kwargs):
        if not worlds or not worlds[-1].is_alive:
            worlds.append(LocalRankGroup())
        layout = DistributedConfig(**(config or {}))
        return raymoe.from_pretrained(checkpoint, distributed_config=layout, world=worlds[-1], **kwargs)

    yield load
    for started in worlds:
        started.shutdown()


@pytest.fixture(scope="session")
def s3_server():
    """A local S3-compatible server (moto's standalone server) on ``S3_PORT``, for the whole session."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=S3_PORT, verbose=False)
    server.start()
    yield f"http://127.0.0.1:{S3_PORT}"
    server.stop()


@pytest.fixture
def s3_bucket(s3_server, request):
    """``s3://<bucket>``: a new, empty bucket on the local server for this test (through s3fs)."""
    import fsspec

    name = "raymoe-" + "".join(c if c.isalnum() else "-" for c in request.node.name.lower())[:40].strip("-")
    name = f"{name}-{len(_BUCKETS)}"
    _BUCKETS.append(name)
    fsspec.filesystem("s3").mkdir(name)
    return f"s3://{name}"


_BUCKETS: list[str] = []


# --- multi-rank CPU process groups (gloo) for torch.distributed tests --------------------------


def _load_rank_harness():
    """tests/distributed.py, loaded by path: ``--import-mode=importlib`` keeps tests/ off sys.path."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "raymoe_tests_distributed", Path(__file__).with_name("distributed.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def tp2():
    """Two CPU ranks in one gloo group (a 1-D tp mesh), started on first use and shared by the session.

    ``tp2.run(check, *args)`` calls ``check(rank, *args)`` on both ranks; see tests/distributed.py.
    """
    group = _load_rank_harness().GlooWorld(world_size=2)
    yield group
    group.close()


@pytest.fixture(scope="session")
def world4():
    """Four CPU ranks in one gloo group, for layouts that combine tp, fsdp and ep: ``rank.context(**config)``.

    ``world4.run(check, *args)`` calls ``check(rank, *args)`` on every rank; see tests/distributed.py.
    """
    group = _load_rank_harness().GlooWorld(world_size=4)
    yield group
    group.close()


# --- tiny random transformers checkpoints: the numerical reference -------------------------------
#
# Tiny random transformers models: the numerical reference of raymoe's model and checkpoint tests.
#
# Every config is small enough that a forward, a training step and a save take milliseconds,
# and together they cover the shapes the model code must handle: odd top-k, expert counts that
# are not powers of two, several GQA ratios, tied and untied heads, dense layers between sparse
# ones, attention biases and the RoPE scalings raymoe implements.
#
# Tests get them through fixtures (``--import-mode=importlib`` makes helper modules unimportable):
# ``tiny_name`` / ``moe_name`` parametrize over configs, ``tiny_checkpoint(name)`` is a directory
# written by transformers' ``save_pretrained``, ``make_hf_model`` / ``load_hf_model`` build references.

MOE_SHAPE = dict(vocab_size=96, max_position_embeddings=256)

# Each entry builds its config from the transformers module it is given (imported only when a fixture needs it).
TINY_CONFIGS: dict[str, Callable[[Any], Any]] = {
    # 5 experts, top-3, GQA 2, a dense layer in the middle, normalised top-k.
    "moe_e5_k3_gqa2_dense_mid": lambda transformers: transformers.Qwen3MoeConfig(
        **MOE_SHAPE,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=5,
        num_experts_per_tok=3,
        mlp_only_layers=[1],
        norm_topk_prob=True,
    ),
    # 6 experts, top-1, GQA 3, tied head, every second layer sparse, odd intermediate (padded GEMM path).
    "moe_e6_k1_gqa3_tied_step2": lambda transformers: transformers.Qwen3MoeConfig(
        **MOE_SHAPE,
        hidden_size=48,
        intermediate_size=40,
        moe_intermediate_size=10,
        num_hidden_layers=4,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=6,
        num_experts_per_tok=1,
        decoder_sparse_step=2,
        tie_word_embeddings=True,
        attention_bias=True,
    ),
    # 8 experts, top-2, multi-head (no GQA), head_dim != hidden/heads, aligned dims (torch._grouped_mm path).
    "moe_e8_k2_mha": lambda transformers: transformers.Qwen3MoeConfig(
        **MOE_SHAPE,
        hidden_size=64,
        intermediate_size=64,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=8,
        num_experts=8,
        num_experts_per_tok=2,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
    ),
    # Llama, GQA 2, biases, Llama-3.1 RoPE scaling with all three frequency bands in use.
    "llama_gqa2_llama3_rope_bias": lambda transformers: transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        attention_bias=True,
        mlp_bias=True,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    # Llama, tied head, multi-head, linear RoPE scaling.
    "llama_mha_tied_linear_rope": lambda transformers: transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    ),
    # Llama, four kv heads and a vocabulary divisible by 4: splits four ways under tensor parallelism.
    "llama_mha4": lambda transformers: transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
    ),
    # Qwen3 dense, GQA 4 (one kv head), tied head, q/k norms.
    "qwen3_gqa4_tied": lambda transformers: transformers.Qwen3Config(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    ),
    # gpt-oss: 4 experts, top-3, GQA 2, head_dim 6, three layers (sliding, full, sliding; window 5), a SwiGLU
    # clamp low enough to bite on random weights, YaRN RoPE (the family default), untied head.
    "gptoss_e4_k3_gqa2_window5": lambda transformers: transformers.GptOssConfig(
        vocab_size=96,
        max_position_embeddings=256,
        hidden_size=40,
        intermediate_size=12,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=6,
        num_local_experts=4,
        num_experts_per_tok=3,
        sliding_window=5,
        swiglu_limit=0.1,
    ),
    # Mixtral: 8 experts, top-3, GQA 2, head_dim 6 (not hidden / heads), sliding window 6 on every layer.
    "mixtral_e8_k3_gqa2_window6": lambda transformers: transformers.MixtralConfig(
        vocab_size=96,
        max_position_embeddings=256,
        hidden_size=36,
        intermediate_size=10,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=6,
        num_local_experts=8,
        num_experts_per_tok=3,
        sliding_window=6,
    ),
    # Qwen2-MoE: 8 experts, top-3, GQA 2, head_dim 6, q/k/v biases (none on o_proj), a gated shared expert, the
    # middle layer dense (mlp_only_layers), untied head.
    "qwen2moe_e8_k3_gqa2_shared": lambda transformers: transformers.Qwen2MoeConfig(
        vocab_size=96,
        max_position_embeddings=256,
        hidden_size=36,
        intermediate_size=40,
        moe_intermediate_size=10,
        shared_expert_intermediate_size=12,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=6,
        num_experts=8,
        num_experts_per_tok=3,
        mlp_only_layers=[1],
    ),
    # GLM-4.5: sigmoid routing (one expert group, as on the hub; DeepSeek-V3's configs below limit groups), top-3,
    # a correction bias (set by make_hf_model), routed scaling, two shared experts, the first layer dense, q/k/v
    # biases, q/k norms, RoPE on half of each head (the family default), untied head.
    "glm4moe_e8_k3_shared2_qknorm": lambda transformers: transformers.Glm4MoeConfig(
        vocab_size=96,
        max_position_embeddings=256,
        hidden_size=36,
        intermediate_size=40,
        moe_intermediate_size=10,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=8,
        n_routed_experts=8,
        num_experts_per_tok=3,
        routed_scaling_factor=1.7,
        n_shared_experts=2,
        first_k_dense_replace=1,
        use_qk_norm=True,
        attention_bias=True,
    ),
    # DeepSeek-V3: MLA with a query rank, interleaved rotary channels and YaRN (mscale / mscale_all_dim, so the
    # softmax scale changes too); sigmoid routing over 4 groups of 2 (best 2), top-3, correction bias, scaling
    # 2.5, two shared experts, the first layer dense, untied head.
    "deepseekv3_e8_k3_groups_qlora_yarn": lambda transformers: transformers.DeepseekV3Config(
        vocab_size=96,
        max_position_embeddings=256,
        hidden_size=36,
        intermediate_size=40,
        moe_intermediate_size=6,
        n_shared_experts=2,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=12,
        kv_lora_rank=10,
        qk_nope_head_dim=6,
        qk_rope_head_dim=4,
        v_head_dim=5,
        n_routed_experts=8,
        num_experts_per_tok=3,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        first_k_dense_replace=1,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "mscale": 1.0,
            "mscale_all_dim": 0.7,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
        },
    ),
    # DeepSeek-V3 with a plain q_proj (q_lora_rank null), biases on q_a/kv_a/o, half-split rotary channels, one
    # expert group, no top-k renormalisation, two layers both sparse.
    "deepseekv3_e8_k2_qproj_bias": lambda transformers: transformers.DeepseekV3Config(
        vocab_size=96,
        max_position_embeddings=256,
        hidden_size=36,
        intermediate_size=40,
        moe_intermediate_size=6,
        n_shared_experts=2,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=None,
        kv_lora_rank=10,
        qk_nope_head_dim=6,
        qk_rope_head_dim=4,
        v_head_dim=5,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        norm_topk_prob=False,
        first_k_dense_replace=0,
        attention_bias=True,
        rope_interleave=False,
    ),
    # gpt-oss with hidden and expert sizes in whole MXFP4 blocks of 32 (the base of the quantized checkpoint).
    "gptoss_mxfp4_base": lambda transformers: transformers.GptOssConfig(
        vocab_size=96,
        max_position_embeddings=256,
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=4,
    ),
}
MXFP4_BASE = "gptoss_mxfp4_base"
PARITY_CONFIGS = [name for name in TINY_CONFIGS if name != MXFP4_BASE]  # the base has its own test (MXFP4)
MOE_CONFIGS = [name for name in TINY_CONFIGS if name.startswith("moe")]
# Routed-expert families besides Qwen3-MoE (tests/models/test_families.py, tests/rank/test_families.py).
FAMILY_MOE_CONFIGS = [
    "gptoss_e4_k3_gqa2_window5",
    "mixtral_e8_k3_gqa2_window6",
    "qwen2moe_e8_k3_gqa2_shared",
    "glm4moe_e8_k3_shared2_qknorm",
    "deepseekv3_e8_k3_groups_qlora_yarn",
    "deepseekv3_e8_k2_qproj_bias",
]


@pytest.fixture(params=PARITY_CONFIGS)
def tiny_name(request: pytest.FixtureRequest) -> str:
    """Each tiny config in turn."""
    return str(request.param)


@pytest.fixture(params=MOE_CONFIGS)
def moe_name(request: pytest.FixtureRequest) -> str:
    """Each tiny Qwen3-MoE config in turn."""
    return str(request.param)


def _make_hf_model(name: str, seed: int = 0) -> Any:
    """A randomly initialised fp32 transformers model; norms and biases perturbed so their loading is tested too."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(TINY_CONFIGS[name](transformers), dtype=torch.float32)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param_name.endswith("norm.weight"):
                param.normal_(1.0, 0.1)
            elif param_name.endswith("bias"):
                param.normal_(0.0, 0.02)
        for buffer_name, buffer in model.named_buffers():
            if buffer_name.endswith("e_score_correction_bias"):  # a selection bias (DeepSeek-V3, GLM-4.5)
                buffer.normal_(0.0, 0.05)
    return model.eval()


def _load_hf_model(directory: Path) -> Any:
    import transformers

    # The eager experts loop is transformers' plainest definition (and its grouped_mm path fails
    # on CPU for dims that are not 16-byte multiples).
    config = json.loads((Path(directory) / "config.json").read_text())
    routed = any(key in config for key in ("num_experts", "num_local_experts", "n_routed_experts"))
    options = {"experts_implementation": "eager"} if routed else {}
    return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, **options).eval()


def _in_raymoe_layout(model_type: str, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """A transformers parameter (or its gradient) in raymoe's layout: gpt-oss's expert weights are ``x @ W``
    (``[E, in, out]``) there and ``nn.Linear`` (``[E, out, in]``) here; every other tensor is the same."""
    if model_type == "gpt_oss" and name.endswith(("experts.gate_up_proj", "experts.down_proj")):
        return tensor.transpose(-2, -1)
    return tensor


@pytest.fixture(scope="session")
def in_raymoe_layout() -> Callable[[str, str, torch.Tensor], torch.Tensor]:
    """``in_raymoe_layout(model_type, name, tensor)``: a transformers parameter as raymoe's ``name`` holds it."""
    return _in_raymoe_layout


@pytest.fixture(scope="session")
def make_hf_model() -> Callable[..., Any]:
    """``make_hf_model(name, seed=0)``: a fresh random reference model."""
    return _make_hf_model


@pytest.fixture(scope="session")
def load_hf_model() -> Callable[[Path], Any]:
    """``load_hf_model(directory)``: transformers' ``from_pretrained`` in fp32, eval mode, eager experts."""
    return _load_hf_model


def _reference_training(
    hf_model: Any,
    data: list[tuple[torch.Tensor, torch.Tensor]],
    lr: float,
    weight_decay: float,
) -> tuple[list[float], list[float], Any]:
    model = copy.deepcopy(hf_model).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    losses, norms = [], []
    for ids, mask in data:
        loss = model(input_ids=ids, labels=ids.masked_fill(mask == 0, -100)).loss
        loss.backward()
        norms.append(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, norms, model


@pytest.fixture(scope="session")
def reference_training() -> Callable[..., tuple[list[float], list[float], Any]]:
    """``reference_training(hf_model, [(ids, mask), ...], lr, weight_decay)``: transformers in one process,
    AdamW, loss = mean over the label tokens (mask 0 -> label -100) -> losses, gradient norms, trained copy."""
    return _reference_training


def _padded_batches(vocab: int, *, steps: int, rows: int, seq: int, seed: int = 0) -> list[tuple[Any, Any]]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for step in range(steps):
        ids = torch.randint(0, vocab, (rows, seq), generator=gen)
        mask = torch.ones_like(ids)
        for row in range(rows):
            pad = (row * 3 + step) % (seq - 2)
            if pad:
                mask[row, -pad:] = 0
        out.append((ids, mask))
    return out


@pytest.fixture(scope="session")
def padded_batches() -> Callable[..., list[tuple[Any, Any]]]:
    """``padded_batches(vocab, steps=, rows=, seq=, seed=0)``: ``(input_ids, attention_mask)`` global batches whose
    rows are right-padded to different lengths, so data-parallel ranks hold uneven numbers of tokens."""
    return _padded_batches


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``tiny_checkpoint(name)``: the directory of a transformers-saved checkpoint, made once per session."""
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            made[name] = tmp_path_factory.mktemp(name)
            _make_hf_model(name).save_pretrained(made[name])
        return made[name]

    return get


# --- MXFP4 checkpoints, quantized here from the documented format ---------------------------------
#
# 32 values share one e8m0 scale 2**(s - 127); each value is an e2m1 code (1 sign, 2 exponent, 1 mantissa
# bit), two codes per byte, low nibble first. Written independently of raymoe's decoder.

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def _quantize_mxfp4(weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[..., R, C]`` float -> blocks uint8 ``[..., R, C/32, 16]``, scales uint8 ``[..., R, C/32]``.

    Per block the smallest power of two ``2**e`` with ``max|x| <= 6 * 2**e``, then the nearest e2m1 code.
    """
    *lead, cols = weights.shape
    groups = weights.double().reshape(*lead, cols // 32, 32)
    amax = groups.abs().amax(-1)
    exponent = torch.where(amax > 0, torch.ceil(torch.log2(amax / 6)), torch.zeros_like(amax))
    codes = (groups / torch.exp2(exponent)[..., None])[..., None] - torch.tensor(E2M1, dtype=torch.float64)
    nibbles = codes.abs().argmin(-1).to(torch.uint8)  # nearest code (+0.0 before -0.0)
    blocks = nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)
    return blocks, (exponent + 127).to(torch.uint8)


def _exact_mxfp4_weights(shape: tuple[int, ...], seed: int = 0, exponents: tuple[int, int] = (-12, 4)) -> torch.Tensor:
    """e2m1 values times a power of two per 32-value block, each block holding a +-6 (so its scale is that power)."""
    generator = torch.Generator().manual_seed(seed)
    *lead, cols = shape
    values = torch.tensor(E2M1)[torch.randint(0, 16, (*lead, cols // 32, 32), generator=generator)]
    values[..., 0] = torch.where(torch.rand(values.shape[:-1], generator=generator) < 0.5, 6.0, -6.0)
    powers = torch.exp2(torch.randint(*exponents, (*lead, cols // 32, 1), generator=generator).float())
    return (values * powers).reshape(shape)


@pytest.fixture(scope="session")
def quantize_mxfp4() -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """``quantize_mxfp4(weights [..., R, C])`` -> ``(blocks [..., R, C/32, 16], scales [..., R, C/32])`` uint8."""
    return _quantize_mxfp4


@pytest.fixture(scope="session")
def exact_mxfp4_weights() -> Callable[..., torch.Tensor]:
    """``exact_mxfp4_weights(shape, seed=0)``: weights MXFP4 represents exactly (last dim a multiple of 32)."""
    return _exact_mxfp4_weights


@pytest.fixture(scope="session")
def gpt_oss_mxfp4_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """``(plain, quantized)``: a tiny gpt-oss saved by transformers whose expert weights MXFP4 holds exactly, and
    the same model as hub gpt-oss ships it (experts as ``*_blocks`` + ``*_scales``, ``quantization_config``)."""
    from safetensors.torch import load_file, save_file

    model = _make_hf_model(MXFP4_BASE)
    with torch.no_grad():
        for seed, (name, param) in enumerate(model.named_parameters()):
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # [E, in, out], x @ W
                exact = _exact_mxfp4_weights(param.transpose(1, 2).shape, seed=seed, exponents=(-9, -5))
                param.copy_(exact.transpose(1, 2))
    plain = tmp_path_factory.mktemp("gptoss_mxfp4_plain")
    model.save_pretrained(plain)
    quantized = tmp_path_factory.mktemp("gptoss_mxfp4_quantized")
    tensors = {}
    for key, tensor in load_file(plain / "model.safetensors").items():
        if key.endswith(("experts.gate_up_proj", "experts.down_proj")):
            # The hub's quantized orientation is [E, out, in], blocks of 32 along `in`.
            tensors[f"{key}_blocks"], tensors[f"{key}_scales"] = _quantize_mxfp4(tensor.transpose(1, 2).contiguous())
        else:
            tensors[key] = tensor
    save_file(tensors, quantized / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((plain / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    (quantized / "config.json").write_text(json.dumps(config, indent=2))
    return plain, quantized


# --- block-scaled FP8 checkpoints (DeepSeek-V3, Kimi-K2), quantized here from the documented format ---------
#
# Each (rows x cols) block of a weight shares one float32 scale s (stored as `weight_scale_inv`); the weight is
# stored as float8_e4m3fn q with q * s the value. Written independently of raymoe's reader.

DEEPSEEK_FP8_BASE = "deepseekv3_e8_k3_groups_qlora_yarn"
FP8_BLOCK = (2, 2)  # divides every quantized dim of the tiny model (transformers' CPU dequantization needs it)


def _quantize_fp8_blocks(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``[R, C]`` float -> (float8_e4m3fn ``[R, C]``, float32 scales ``[R / br, C / bc]``), largest value -> 448."""
    rows, cols = weight.shape
    br, bc = block
    blocks = weight.float().reshape(rows // br, br, cols // bc, bc)
    scales = blocks.abs().amax(dim=(1, 3)) / 448.0
    quantized = (blocks / scales[:, None, :, None]).reshape(rows, cols).to(torch.float8_e4m3fn)
    return quantized, scales


def _fp8_quantized_name(key: str) -> bool:
    """The tensors DeepSeek-V3's hub checkpoints hold in FP8: every projection weight of a layer (not the router)."""
    return key.startswith("model.layers.") and key.endswith("proj.weight") and ".mlp.gate." not in key


@pytest.fixture(scope="session")
def deepseek_fp8_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    """``(directory, dequantized)``: a tiny DeepSeek-V3 as the hub ships it (projection weights FP8 with
    ``weight_scale_inv``, ``quantization_config.quant_method: fp8``) and the values its FP8 tensors stand for."""
    from safetensors.torch import load_file, save_file

    plain = tmp_path_factory.mktemp("deepseek_fp8_plain")
    _make_hf_model(DEEPSEEK_FP8_BASE).save_pretrained(plain)
    quantized = tmp_path_factory.mktemp("deepseek_fp8_quantized")
    tensors, dequantized = {}, {}
    for key, tensor in load_file(plain / "model.safetensors").items():
        if _fp8_quantized_name(key):
            q, scales = _quantize_fp8_blocks(tensor, FP8_BLOCK)
            tensors[key], tensors[f"{key}_scale_inv"] = q, scales
            expanded = scales.repeat_interleave(FP8_BLOCK[0], 0).repeat_interleave(FP8_BLOCK[1], 1)
            dequantized[key] = q.float() * expanded
        else:
            tensors[key] = tensor
    save_file(tensors, quantized / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((plain / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(FP8_BLOCK),
    }
    (quantized / "config.json").write_text(json.dumps(config, indent=2))
    return quantized, dequantized


# --- RL references in plain torch (issue 31): log-probs, policy losses, a transformers router forced to routes ---


class PlainRL:
    """One-process references for the RL tests, on a transformers model; nothing of raymoe."""

    @staticmethod
    def logprobs(hf_model: Any, ids: torch.Tensor, temperature: float = 1.0, attention_mask: Any = None) -> Any:
        """``[B, S]``: entry t = log_softmax(logits[t - 1] / T)[ids[t]], entry 0 = 0 (with the graph)."""
        logits = hf_model(input_ids=ids, attention_mask=attention_mask).logits.float() / temperature
        logp = torch.log_softmax(logits, dim=-1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
        return torch.nn.functional.pad(logp, (1, 0))

    @staticmethod
    def entropy(hf_model: Any, ids: torch.Tensor, temperature: float = 1.0) -> Any:
        logp = torch.log_softmax(hf_model(input_ids=ids).logits.float() / temperature, dim=-1)
        return torch.nn.functional.pad(-(logp.exp() * logp).sum(-1)[:, :-1], (1, 0))

    @staticmethod
    def loss(lp, old, adv, ref, mask, kind, aggregation, *, clip_low=0.2, clip_high=None, clip_c=None, kl_coef=0.0,
             max_new_tokens=None):  # fmt: skip
        """The policy loss as the RL papers write it (PPO / DAPO clip, dual clip, k3 KL, three aggregations)."""
        ratio = torch.exp(lp - old)
        high = clip_low if clip_high is None else clip_high
        if kind == "ppo":
            pg = torch.max(-adv * ratio, -adv * torch.clamp(ratio, 1 - clip_low, 1 + high))
            if clip_c is not None:
                pg = torch.where(adv < 0, torch.min(pg, -adv * clip_c), pg)
        else:
            pg = -adv * ratio
        per = pg
        if kl_coef:
            delta = ref - lp
            per = pg + kl_coef * (torch.exp(delta) - delta - 1)
        m = mask.float()
        if aggregation == "token-mean":
            return (per * m).sum() / m.sum()
        if aggregation == "sequence-mean":
            rows = m.sum(1) > 0
            return ((per * m).sum(1)[rows] / m.sum(1)[rows]).mean()
        return (per * m).sum() / (mask.shape[0] * max_new_tokens)

    @staticmethod
    def rollout(vocab: int, rows: int = 4, seq: int = 8, seed: int = 0) -> tuple[Any, Any, Any]:
        """``(ids, loss_mask, advantages)``: completions of different lengths after a 3-token prompt."""
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, vocab, (rows, seq), generator=g)
        mask = torch.zeros(rows, seq, dtype=torch.bool)
        for r in range(rows):
            mask[r, 3 : max(4, seq - r % 4)] = True
        adv = torch.randn(rows, 1, generator=g).expand(rows, seq).contiguous()
        return ids, mask, adv

    @staticmethod
    def forced(routes_BSLK: torch.Tensor, num_experts: int, top_k: int) -> Any:
        """A context in which transformers' routers choose ``routes`` (``[B, S, L_moe, K]``, layer by layer in
        forward order): ``torch.topk`` on a ``[T, num_experts]`` score with ``k = top_k`` answers the forced ids (and
        the scores at them); transformers' routers then weight them as they weight their own choice."""
        import contextlib

        real = torch.topk
        per_layer = [routes_BSLK[:, :, j].reshape(-1, top_k).long() for j in range(routes_BSLK.shape[2])]
        calls = iter(range(10**6))

        def topk(input, k, dim=-1, largest=True, sorted=True):
            if input.dim() == 2 and input.shape[-1] == num_experts and k == top_k:
                ids = per_layer[next(calls) % len(per_layer)]
                return torch.return_types.topk((input.gather(-1, ids), ids))
            return real(input, k, dim=dim, largest=largest, sorted=sorted)

        @contextlib.contextmanager
        def patched():
            torch.topk = topk
            try:
                yield
            finally:
                torch.topk = real

        return patched()


@pytest.fixture(scope="session")
def plain_rl() -> type[PlainRL]:
    """:class:`PlainRL`: the RL tests' one-process references."""
    return PlainRL


# --- what rank-side tests share: a step's memory, an injected failure -------------------------------------------


def _peak_of(fn: Callable[[], object]) -> int:
    """The most CPU tensor bytes ``fn()`` ever held beyond what was live at its start.

    Torch's profiler records every allocation and free made while it runs (``profile_memory``); their running sum,
    in time order, is what the call holds at each moment on top of its start. A free of a tensor that was live
    before the call is not recorded, so the figure can only overstate the call's peak (the test's bound holds
    all the more). The raw allocation records are read rather than the profiler's memory timeline, whose
    data-flow check asserts now and then on a storage address reused within one op.
    """
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities, profile_memory=True) as p:
        fn()
    pending, records = list(p.profiler.kineto_results.experimental_event_tree()), []
    while pending:
        event = pending.pop()
        pending.extend(event.children)
        if event.tag == _EventType.Allocation and event.extra_fields.device.type == "cpu":
            records.append((event.start_time_ns, event.extra_fields.alloc_size))
    held = np.cumsum([size for _, size in sorted(records)])
    return max(int(held.max()), 0) if len(held) else 0


@pytest.fixture(scope="session")
def peak_of() -> Callable[[Callable[[], object]], int]:
    """``peak_of(fn)``: the most CPU tensor bytes ``fn()`` held beyond what was live at its start (profiler)."""
    return _peak_of


def _fail_at_forward(ctx: Any, at: int) -> None:
    """The rank's ``at``-th forward from now raises (its own error: the failure is this rank's)."""
    seen = []

    def hook(*_):
        seen.append(1)
        if len(seen) == at:
            raise RuntimeError("injected failure")

    ctx.require_model().model.register_forward_pre_hook(hook)


@pytest.fixture(scope="session")
def fail_at_forward() -> Callable[[Any, int], None]:
    """``model.run_on_ranks(fail_at_forward, at)`` on a local world: that rank's ``at``-th forward from now raises."""
    return _fail_at_forward
