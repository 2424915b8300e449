"""The public entry points that start ranks: ``raymoe.from_pretrained`` and ``raymoe.start_world``; and
``raymoe.plan``, which simulates them (:class:`raymoe.rank.fake.FakeWorlds`) to say what each would hold.

The composition root: everything checkable without a cluster is checked here first (config,
plans, the checkpoint's ``config.json``, in :mod:`raymoe.spec.launch`), then the Ray side
(``actors/``) places the ranks and the driver handle (:mod:`raymoe.driver.handle`) loads the shards.
This is the only raymoe module that imports ``actors``, and only inside these functions, so
``import raymoe`` never imports ``ray``.
"""

from __future__ import annotations

import inspect
import os
from typing import TYPE_CHECKING, Any

import torch

from raymoe.driver import dataset as driver_dataset
from raymoe.driver.group import RankGroup
from raymoe.driver.handle import DistributedModel
from raymoe.driver.memory_plan import MemoryPlan
from raymoe.driver.packing import PackedData
from raymoe.driver.plan import plan_memory
from raymoe.driver.ray_engine import DECODING, RayJob, check_engine, check_ray_options, ray_source, read_format
from raymoe.driver.records import open_hub_dataset
from raymoe.driver.streamed_data import StreamedData
from raymoe.driver.tokenizer import TextTokenizer
from raymoe.rank.contract import DEFAULT_COLLECTIVE_TIMEOUT_S, Backend
from raymoe.rank.fake import FakeWorlds
from raymoe.spec.config import DistributedConfig
from raymoe.spec.launch import as_config, prepare_launch
from raymoe.spec.lora import LoraConfig
from raymoe.spec.shared_paths import launch_reads

if TYPE_CHECKING:
    from actors.group import GroupOptions, RayRankGroup


def from_pretrained(
    name_or_path: str | os.PathLike[str],
    *,
    distributed_config: DistributedConfig | dict[str, Any] | None = None,
    dtype: torch.dtype | str | None = None,
    precision: str | None = None,
    world_size: int | None = None,
    revision: str | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    world: RankGroup | None = None,
    use_gpu: bool | None = None,
    cpus_per_rank: float = 1.0,
    backend: Backend | None = None,
    placement_timeout_s: float = 120.0,
    collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S,
    lora: LoraConfig | str | os.PathLike[str] | dict[str, Any] | None = None,
    quantized_experts: str | None = None,
    compile: bool | str | None = None,
) -> DistributedModel:
    """Load ``name_or_path`` (a local directory or a hub id) sharded over Ray rank actors.

    ``precision`` (:mod:`raymoe.spec.precision`): ``"bf16-mixed"`` (float32 master weights, gradients and AdamW
    states; bf16 compute; the default for a bf16 checkpoint), ``"fp32"``, ``"bf16-pure"`` (only when asked: small
    updates are lost) or ``None``/``"auto"``: the policy of ``dtype`` (the checkpoint's by default). For inference
    alone, ``"bf16-pure"`` holds half the bytes of ``"bf16-mixed"`` and gives the same logits.

    ``lora`` (:mod:`raymoe.spec.lora`): a :class:`~raymoe.LoraConfig` adds fresh adapters, a directory loads a PEFT
    adapter (``adapter_config.json`` + ``adapter_model.safetensors``, each rank its slices); the base is then
    frozen (no gradients, no optimizer state) and held in the compute dtype, the adapters in ``lora_dtype``.
    ``quantized_experts="mxfp4"`` (with ``lora``, for a checkpoint storing MXFP4 experts, e.g. gpt-oss) keeps the
    frozen expert weights packed on the ranks (uint8 blocks and scales, 4.25 bits a weight), dequantized inside each
    projection in forward and again in backward (:mod:`raymoe.models.moe.packed`).

    ``compile`` (:mod:`raymoe.spec.compile`): ``torch.compile`` each decoder block's forward on the ranks (after TP/EP
    and activation checkpointing, before FSDP2). ``None`` (default): on CUDA GPUs, not on CPU; ``True``: on any
    device; ``False``: eager everywhere; a backend's name (``"aot_eager"``, ``"inductor"``): on any device, by that
    backend. A block compiles at its first step of a new shape (the progress output says how long); generation stays
    eager.

    A relative directory is taken from this process's working directory and sent to the ranks as an absolute
    path (rank processes may run elsewhere: another directory, another node).

    Everything that can be checked without a cluster (config, plans, the checkpoint's
    config.json) is checked first; then Ray is joined (``RAY_ADDRESS``, a cluster started on
    this machine, or a new local instance), the cluster is checked for room, one actor per
    rank is placed and each rank loads only its shard. ``use_gpu=None`` uses GPUs when the
    cluster has any. ``world_size`` is only needed with ``tp_plan="auto"`` and no ``tp_size``;
    it defaults then to the cluster's GPU count (or to the world's size).

    ``world`` (from :func:`start_world`, or a :class:`~raymoe.rank.local.LocalRankGroup`: one rank in this
    process, no Ray) loads onto ranks that are already running instead of starting new ones: the layout must
    have ``world.world_size`` ranks, and the handle's ``shutdown`` then unloads the model and leaves the ranks
    for the next ``from_pretrained``.
    The placement options (``use_gpu`` ... ``collective_timeout_s``) belong to the world then: one given here is a
    ValueError (it would change nothing).

    ``collective_timeout_s`` (default 300) bounds how long any collective may wait, on every process group
    (world and each sub-mesh); past it, the driver names the ranks the others wait for (a frozen process, a
    rank that never arrived), their coordinates, the sub-mesh and the collective, and frees every rank
    (``actors.RankHangError``). Raise it for a step or a shard read slower than that.
    """
    if world is not None:
        _refuse_placement_options(
            use_gpu=use_gpu,
            cpus_per_rank=cpus_per_rank,
            backend=backend,
            placement_timeout_s=placement_timeout_s,
            collective_timeout_s=collective_timeout_s,
        )
    config = as_config(distributed_config)
    if world is None and config.tp_is_deferred and world_size is None:
        from actors.cluster import cluster_gpus, connect

        connect(num_ranks=1, cpus_per_rank=cpus_per_rank)
        world_size = cluster_gpus()
        if world_size == 0:
            raise ValueError(
                "tp_plan='auto' without tp_size takes the world size from the cluster's GPUs, and it has "
                "none; pass world_size= or set tp_size"
            )
    if world is not None and world_size is None:
        world_size = world.world_size
    spec = prepare_launch(
        name_or_path,
        config,
        world_size=world_size,
        dtype=dtype,
        revision=revision,
        cache_dir=cache_dir,
        precision=precision,
        lora=lora,
        quantized_experts=quantized_experts,
        compile=compile,
    )
    # local paths the ranks read: every node hosting one must see them as this process does
    reads = launch_reads(spec.source, spec.lora.adapter_dir if spec.lora is not None else None)
    if world is not None:
        world.check_shared(reads)
        return DistributedModel.launch(spec, world, owns_group=False)

    from actors.group import RayRankGroup

    options = _group_options(
        spec.topology.world_size, use_gpu, cpus_per_rank, backend, placement_timeout_s, collective_timeout_s
    )
    group = RayRankGroup.for_topology(spec.topology, options, shared=reads)
    return DistributedModel.launch(spec, group, owns_group=True)


def _refuse_placement_options(**given: object) -> None:
    """With ``world=``, ``from_pretrained``'s placement options (set away from their defaults) are a ValueError: the
    ranks run already, placed and timed by the world's own options (:func:`start_world`)."""
    defaults = inspect.signature(from_pretrained).parameters
    changed = [f"{name}={value!r}" for name, value in given.items() if value != defaults[name].default]
    if changed:
        raise ValueError(
            f"from_pretrained(world=...) loads onto ranks already placed: {', '.join(changed)} would change "
            "nothing; those are the world's options (give them to start_world)"
        )


def plan(model: str | os.PathLike[str], *, gpus: int, gpu_memory: str | int, **options: Any) -> MemoryPlan:
    """Which layouts of ``gpus`` GPUs of ``gpu_memory`` (``"80GB"``) fit ``model``, from its ``config.json`` alone:
    per rank the parameters, gradients and AdamW states (exact: the meta model sharded in simulated worlds, as the
    ranks shard it), the step's activations (estimated), the peak, the bytes sent per step, ranked, and the command
    that launches the best (:func:`raymoe.driver.plan.plan_memory`, whose keywords ``options`` are: ``nodes``,
    ``seq_len``, ``batch``, ``lora``, ``quantized_experts``, ``precision``, ``dtype``, ``layouts``, ``all_ranks``,
    ``device``, ``revision``, ``cache_dir``). Runs in this process, which must not hold a torch.distributed world of
    its own (a ``LocalRankGroup``); ``raymoe plan`` is the same on the command line."""
    return plan_memory(model, gpus=gpus, gpu_memory=gpu_memory, worlds=FakeWorlds(), **options)


def start_world(
    world_size: int,
    *,
    block: int = 1,
    use_gpu: bool | None = None,
    cpus_per_rank: float = 1.0,
    backend: Backend | None = None,
    placement_timeout_s: float = 120.0,
    collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S,
) -> RayRankGroup:
    """Start ``world_size`` rank actors in one process group, to load models onto one after another.

    A notebook or a sweep pays for placement, process start-up and rendezvous once: pass the result
    as ``from_pretrained(..., world=...)``. ``block`` consecutive ranks are kept on one node (set it to
    the largest tp / ep size you will use on a multi-node cluster). Use as a context manager, or call
    ``shutdown()``; a rank failure ends the world like it ends an owned group.
    """
    from actors.group import RayRankGroup

    for name, value in (("world_size", world_size), ("block", block)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"start_world: {name}={value!r} must be an int >= 1")
    if world_size % block:
        raise ValueError(f"start_world: block={block} must divide world_size={world_size}")
    options = _group_options(world_size, use_gpu, cpus_per_rank, backend, placement_timeout_s, collective_timeout_s)
    return RayRankGroup.create(world_size, options, block=block)


def _group_options(
    num_ranks: int,
    use_gpu: bool | None,
    cpus_per_rank: float,
    backend: Backend | None,
    placement_timeout_s: float,
    collective_timeout_s: float,
) -> GroupOptions:
    """Join Ray (sized for ``num_ranks`` when it starts a local instance) and settle the group's options;
    ``use_gpu=None`` uses GPUs when the cluster has any."""
    from actors.cluster import cluster_gpus, connect
    from actors.group import GroupOptions

    connect(num_ranks=num_ranks, cpus_per_rank=cpus_per_rank)
    return GroupOptions(
        use_gpu=use_gpu if use_gpu is not None else cluster_gpus() > 0,
        cpus_per_rank=cpus_per_rank,
        backend=backend,
        placement_timeout_s=placement_timeout_s,
        collective_timeout_s=collective_timeout_s,
    )


def load_dataset(
    path: str | os.PathLike[str],
    seq_len: int,
    tokenizer: TextTokenizer | None,
    *,
    engine: str = "driver",
    **options: Any,
) -> PackedData | StreamedData:
    """Read, tokenize and pack ``path`` (:func:`raymoe.driver.dataset.load_dataset` gives the options).

    ``engine="driver"`` (the default) does it in this process (and its worker processes) and gives ``PackedData``.
    ``engine="ray"`` reads, tokenizes and packs as Ray Data operators on the cluster's CPUs
    (:mod:`raymoe.driver.ray_engine`, ``actors/ray_data.py``) and gives :class:`StreamedData`: the rows stay in
    Ray's object store and each data-parallel batch's ranks read theirs there; this process holds references and
    a few numbers a row. The same records give the same rows with the same ``pack_window`` (the Ray engine's
    default: 10000 examples a window); ``StreamedData.collect()`` brings them here.
    """
    check_engine(engine)
    if engine == "driver":
        return driver_dataset.load_dataset(path, seq_len, tokenizer, **options)
    if tokenizer is None:
        raise ValueError("load_dataset(engine='ray') tokenizes text: give a tokenizer")
    rest = check_ray_options(options)
    path = ray_source(path)
    fmt = read_format(path)
    split, config = rest.pop("split", "train"), rest.pop("dataset_config", None)
    from actors.ray_data import read_records

    hub = open_hub_dataset(str(path), split=split, config_name=config) if fmt == "datasets" else None
    records = read_records(str(path), fmt, hub.dataset if hub is not None else None)
    name = hub.name if hub is not None else f"dataset {path}"
    return _ray_packed(records, DECODING[fmt], name, seq_len, tokenizer, rest)


def from_ray_dataset(dataset: Any, *, tokenizer: TextTokenizer, seq_len: int, **options: Any) -> StreamedData:
    """A user's ``ray.data.Dataset`` of records (each row a document or a conversation, as in a ``.jsonl``)
    tokenized and packed on the cluster like ``load_dataset(engine="ray")`` (options: its packing and chat ones,
    ``pack_window``, ``progress``); the rows stay in Ray's object store."""
    return _ray_packed(dataset, "table", "ray dataset", seq_len, tokenizer, check_ray_options(options))


def _ray_packed(
    records: Any, decoding: Any, name: str, seq_len: int, tokenizer: TextTokenizer, options: dict[str, Any]
) -> StreamedData:
    from actors.ray_data import fetch, first_batch, stream_blocks, unwrap

    progress = bool(options.pop("progress", False))
    job = RayJob.of(first_batch(records), decoding, name, seq_len, tokenizer, **options)
    try:
        blocks, stats = stream_blocks(records, job.tokenize, job.pack, job.to_block, job.pack_window, progress)
    except Exception as error:
        cause = unwrap(error)
        if cause is error:
            raise
        raise ValueError(str(cause)) from error
    return job.streamed(blocks, stats, fetch)
