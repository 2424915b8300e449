"""What every rank will do, decided and validated on the driver before any actor starts (SPEC CFG-8, PLAN-4).

    DistributedConfig ──┐
    config.json ────────┼─> topology + meta model -> resolved plans -> LaunchSpec ──> each rank
    world size ─────────┘        (every ValueError is raised here, nothing is read yet)

Only ``config.json`` is fetched here; each rank resolves the weights itself, on its own node. A
checkpoint that is a local directory is also checked here, from its safetensors headers (a few KB per
file): truncated files, missing, unexpected, wrong-shape or wrong-dtype tensors fail before any actor.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from raymoe.checkpoint.adapter import AdapterFile
from raymoe.checkpoint.hub import resolve_config_file
from raymoe.checkpoint.model_io import check_checkpoint
from raymoe.checkpoint.storage import LOCAL, url_scheme
from raymoe.models.common.config import ModelConfig, read_config_file
from raymoe.models.common.decoder import CausalLM
from raymoe.models.common.lora import adapter_parameters
from raymoe.models.registry import build_model, parse_model_config
from raymoe.parallel.context_parallel.all_to_all import check_heads
from raymoe.parallel.packed_experts import check_packed_layout
from raymoe.spec.compile import CompileChoice, check_compile
from raymoe.spec.config import DistributedConfig
from raymoe.spec.lora import LoraConfig, LoraSpec, add_adapters, resolve_lora
from raymoe.spec.pipeline import StagePlan, plan_stages
from raymoe.spec.plans import ResolvedPlans, resolve_plans
from raymoe.spec.precision import Precision, precision_of
from raymoe.spec.topology import Topology, build_topology

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class LaunchSpec:
    """A checked request to load ``source`` over ``topology``; plain data, sent to every rank.

    ``source`` is a hub id or the *absolute* path of a checkpoint directory (made so on the driver: a rank process
    may run in another working directory, on another node). ``config`` is the parsed ``config.json``, parsed
    once here; ``model_config`` the file's raw dict, as training states record it.
    """

    source: str
    revision: str | None
    cache_dir: str | None
    model_config: dict[str, Any]
    config: ModelConfig
    dtype: str | None
    topology: Topology
    plans: ResolvedPlans
    stages: StagePlan | None = None  # pipeline stages (pp_size > 1)
    precision: Precision = Precision.AUTO  # checked against dtype; each rank resolves it (raymoe.spec.precision)
    lora: LoraSpec | None = None  # adapters on a frozen base (raymoe.spec.lora)
    quantized_experts: str | None = None  # "mxfp4": the frozen experts stay packed on the ranks (LoRA only)
    compile: CompileChoice = None  # compiled decoder blocks: None = on CUDA only, a str a backend (raymoe.spec.compile)

    def build_meta_model(self) -> CausalLM:
        """The model on meta, with its LoRA factors (base frozen) when the spec has adapters."""
        model = build_model(self.config, device="meta")
        if self.lora is not None:
            add_adapters(model, self.lora)
        return model

    def build_meta_part(self, stage: int) -> CausalLM:
        """The part of the meta model that pipeline ``stage`` runs (:meth:`CausalLM.keep_part`)."""
        assert self.stages is not None
        model = self.build_meta_model()
        model.keep_part(self.stages.layers(stage), self.stages.is_first(stage), self.stages.is_last(stage))
        return model

    @property
    def torch_dtype(self) -> torch.dtype | None:
        return DTYPES[self.dtype] if self.dtype is not None else None


QUANTIZED_EXPERTS = ("mxfp4",)


def check_quantized_experts(value: str | None, raw: Mapping[str, Any], lora: LoraSpec | None) -> None:
    """``quantized_experts="mxfp4"`` keeps a frozen base's MXFP4 experts packed: only under LoRA (full fine-tuning
    trains the experts, which needs full-precision weights) and only for a checkpoint that stores them so."""
    if value is None:
        return
    if value not in QUANTIZED_EXPERTS:
        raise ValueError(f"quantized_experts={value!r}: the packed formats raymoe keeps are {list(QUANTIZED_EXPERTS)}")
    if lora is None:
        raise ValueError(
            f"quantized_experts={value!r} keeps the expert weights packed, which only a frozen base allows: pass "
            "lora= (full fine-tuning trains the experts and holds them in full precision)"
        )
    quantization = raw.get("quantization_config")
    method = quantization.get("quant_method") if isinstance(quantization, Mapping) else None
    if method != value:
        raise ValueError(
            f"quantized_experts={value!r}: this checkpoint's config.json has quantization_config.quant_method="
            f"{method!r}; only a checkpoint storing its experts in {value} can keep them packed"
        )


def check_context_parallel(model: ModelConfig, config: DistributedConfig) -> None:
    """What context parallelism needs of the model: ``cp_mode='all_to_all'`` gives each cp rank a share of every tp
    rank's query heads, so they must split ``cp_size`` ways (the ring takes any head count)."""
    if not config.splits_sequences or config.cp_mode != "all_to_all":
        return
    tp, cp = config.tp_size or 1, config.cp_size or 1
    check_heads(
        model.num_attention_heads // tp, cp, f"{model.model_type} ({model.num_attention_heads} heads / tp {tp})"
    )


def as_config(distributed_config: DistributedConfig | dict[str, Any] | None) -> DistributedConfig:
    if distributed_config is None:
        return DistributedConfig()
    if isinstance(distributed_config, dict):
        return DistributedConfig.from_dict(distributed_config)
    if not isinstance(distributed_config, DistributedConfig):
        raise ValueError(
            f"distributed_config must be a raymoe.DistributedConfig, a dict or None, got {type(distributed_config)}"
        )
    return distributed_config


def dtype_name(dtype: torch.dtype | str | None) -> str | None:
    """``None``/``"auto"`` keep the checkpoint's dtype; otherwise one of :data:`DTYPES`."""
    if dtype is None or dtype == "auto":
        return None
    for name, value in DTYPES.items():
        if dtype in (name, value):
            return name
    raise ValueError(f"dtype={dtype!r} is not supported; use one of {', '.join(DTYPES)}, 'auto' or None")


def prepare_launch(
    name_or_path: str | os.PathLike[str],
    distributed_config: DistributedConfig | dict[str, Any] | None = None,
    *,
    world_size: int | None = None,
    dtype: torch.dtype | str | None = None,
    revision: str | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    precision: Precision | str | None = None,
    lora: LoraConfig | str | os.PathLike[str] | Mapping[str, Any] | None = None,
    quantized_experts: str | None = None,
    compile: CompileChoice = None,
    weights: bool = True,
) -> LaunchSpec:
    """Validate everything that can be validated without a cluster; raise ``ValueError`` on bad input.

    ``weights=False``: from ``config.json`` alone (``raymoe.plan``): a local directory's weights are neither needed
    nor checked."""
    config = as_config(distributed_config)
    compiled = check_compile(compile)
    dtype_of_weights = dtype_name(dtype)
    asked = DTYPES[dtype_of_weights] if dtype_of_weights else None
    policy = precision_of(precision, asked, config.fsdp_mixed_precision)
    topology = build_topology(config, world_size)
    if cache_dir is not None and url_scheme(str(cache_dir)) is not None:  # never a local folder named "s3:"
        raise ValueError(f"cache_dir={str(cache_dir)!r} must be a local directory path, not a URL")
    config_file = resolve_config_file(name_or_path, revision=revision, cache_dir=cache_dir)
    raw = read_config_file(config_file.parent)
    model_config = parse_model_config(raw)
    model = build_model(model_config, device="meta")
    source = str(name_or_path)
    scheme = url_scheme(source)
    local: Path | None = Path(name_or_path).expanduser() if scheme is None else config_file.parent
    if scheme is not None and scheme not in LOCAL:  # a storage URL: each rank copies what it reads onto its node
        local = None
    if local is not None and local.is_dir():  # a hub id's weights are fetched by each rank, on its node
        if weights:
            check_checkpoint(local, model)
        source = str(local.absolute())
    adapters = resolve_lora(lora, model) if lora is not None else None
    check_quantized_experts(quantized_experts, raw, adapters)
    if adapters is not None:
        add_adapters(model, adapters)
        if adapters.adapter_dir is not None:  # its tensors' names and shapes, from the safetensors header
            shapes = {name: tuple(param.shape) for name, param in adapter_parameters(model)}
            AdapterFile(adapters.adapter_dir, adapters.targets).check(shapes)
    check_context_parallel(model_config, topology.config)
    plans = resolve_plans(model, model.default_plans(), topology.config, num_experts=model.num_experts)
    if quantized_experts is not None:  # the rules' splits must keep every MXFP4 group of 32 whole
        check_packed_layout(model, plans.tp_rules, plans.styles, topology.config.tp_size or 1)
        check_packed_layout(model, plans.ep_rules, plans.styles, topology.config.ep_size or 1)
    stages = plan_stages(model, topology.config)
    return LaunchSpec(
        source=source,
        revision=revision,
        cache_dir=str(Path(cache_dir).expanduser().absolute()) if cache_dir is not None else None,
        model_config=raw,
        config=model_config,
        dtype=dtype_of_weights,
        topology=topology,
        plans=plans,
        stages=stages,
        precision=policy,
        lora=adapters,
        quantized_experts=quantized_experts,
        compile=compiled,
    )
