"""LoRA adapters as the user asks for them (PEFT's ``LoraConfig`` field names), checked and resolved on the driver.

    LoraConfig (or a PEFT adapter_config.json) ──> resolve_lora(config, meta model) ──> LoraSpec (in the LaunchSpec)
        targets: every adapted nn.Linear and fused expert weight, with its r and scale, by raymoe's (= transformers')
        module paths; any field raymoe does not support, or a target that matches nothing, is a ValueError here

Matching follows PEFT: ``target_modules`` as a list matches a module whose path is an entry or ends with
``"." + entry`` (a string is a regular expression the whole path must match; ``"all-linear"`` is every
``nn.Linear`` but the output head); ``target_parameters`` matches a parameter path the same way (fused expert
weights ``[E, out, in]``: ``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj``). ``rank_pattern`` /
``alpha_pattern`` keys are regular expressions matched against the end of a target's path, first key first.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from raymoe.checkpoint.adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from raymoe.models.common.lora import (
    AdapterShape,
    AdapterTarget,
    add_expert_adapter,
    add_linear_adapter,
    freeze_base,
    scaling_of,
)
from raymoe.models.common.shard_hints import EXPERT_BATCHED_ATTR

LORA_DTYPES = ("float32", "bfloat16")

# PEFT LoraConfig fields raymoe does not implement, each with the value that means "not used". A config that
# sets one to anything else is refused, naming it (never silently trained without it).
_UNSUPPORTED_DEFAULTS: dict[str, Any] = {
    "use_dora": False,
    "lora_bias": False,
    "fan_in_fan_out": False,
    "modules_to_save": None,
    "layers_to_transform": None,
    "layers_pattern": None,
    "exclude_modules": None,
    "layer_replication": None,
    "megatron_config": None,
    "loftq_config": {},
    "eva_config": None,
    "corda_config": None,
    "lora_ga_config": None,
    "use_qalora": False,
    "trainable_token_indices": None,
    "alora_invocation_tokens": None,
    "arrow_config": None,
    "velora_config": None,
    "kasa_config": None,
    "monteclora_config": None,
    "use_bdlora": None,
    "ensure_weight_tying": False,
}
# PEFT fields that describe the file, not the adapter; accepted and ignored.
_METADATA = (
    "peft_type",
    "peft_version",
    "auto_mapping",
    "base_model_name_or_path",
    "revision",
    "inference_mode",
    "task_type",
    "megatron_core",
    "qalora_group_size",
)


@dataclass(frozen=True, init=False)
class LoraConfig:
    """Which weights get adapters and how (PEFT's names and meanings for what raymoe supports).

    ``r`` (8) and ``lora_alpha`` (8): rank and scale ``alpha / r`` (``alpha / sqrt(r)`` with ``use_rslora``);
    ``target_modules`` (nn.Linear paths) and ``target_parameters`` (fused expert weights); ``rank_pattern`` /
    ``alpha_pattern``: per-target overrides; ``lora_dropout``: on the inputs of targeted modules (not of expert
    weights, as in PEFT); ``init_lora_weights``: ``True`` (A Kaiming-uniform, B zero: training starts at the base)
    or ``False`` (both Kaiming-uniform: a non-zero update, for tests); ``bias``: only ``"none"``;
    ``lora_dtype``: the adapters' (and their AdamW states') dtype, float32 by default whatever the base's.
    """

    r: int
    lora_alpha: float
    target_modules: tuple[str, ...] | str | None
    target_parameters: tuple[str, ...]
    rank_pattern: Mapping[str, int]
    alpha_pattern: Mapping[str, float]
    use_rslora: bool
    lora_dropout: float
    init_lora_weights: bool
    bias: str
    lora_dtype: str

    def __init__(
        self,
        r: int = 8,
        lora_alpha: float = 8,
        target_modules: Sequence[str] | str | None = None,
        target_parameters: Sequence[str] | None = None,
        rank_pattern: Mapping[str, int] | None = None,
        alpha_pattern: Mapping[str, float] | None = None,
        use_rslora: bool = False,
        lora_dropout: float = 0.0,
        init_lora_weights: bool = True,
        bias: str = "none",
        lora_dtype: str = "float32",
        **peft_fields: Any,
    ) -> None:
        _refuse_unsupported(peft_fields)
        modules = target_modules if isinstance(target_modules, str) or target_modules is None else tuple(target_modules)
        values = {
            "r": r,
            "lora_alpha": lora_alpha,
            "target_modules": modules,
            "target_parameters": tuple(target_parameters or ()),
            "rank_pattern": dict(rank_pattern or {}),
            "alpha_pattern": dict(alpha_pattern or {}),
            "use_rslora": use_rslora,
            "lora_dropout": lora_dropout,
            "init_lora_weights": init_lora_weights,
            "bias": bias,
            "lora_dtype": lora_dtype,
        }
        for name, value in values.items():
            object.__setattr__(self, name, value)
        self._check()

    def _check(self) -> None:
        _positive_int("r", self.r)
        _positive_number("lora_alpha", self.lora_alpha)
        for key, value in self.rank_pattern.items():
            _positive_int(f"rank_pattern[{key!r}]", value)
        for key, alpha in self.alpha_pattern.items():
            _positive_number(f"alpha_pattern[{key!r}]", alpha)
        if not isinstance(self.lora_dropout, int | float) or not 0.0 <= self.lora_dropout < 1.0:
            raise ValueError(f"LoraConfig.lora_dropout={self.lora_dropout!r} must be a number in [0, 1)")
        if not isinstance(self.init_lora_weights, bool):
            raise ValueError(
                f"LoraConfig.init_lora_weights={self.init_lora_weights!r}: raymoe supports True (PEFT's default: "
                "B = 0) and False (both factors random); PEFT's other initialisations are not implemented"
            )
        if self.bias != "none":
            raise ValueError(f"LoraConfig.bias={self.bias!r}: raymoe trains no biases with LoRA; only 'none'")
        if self.lora_dtype not in LORA_DTYPES:
            raise ValueError(f"LoraConfig.lora_dtype={self.lora_dtype!r} must be one of {LORA_DTYPES}")
        if not isinstance(self.use_rslora, bool):
            raise ValueError(f"LoraConfig.use_rslora={self.use_rslora!r} must be a bool")
        if self.use_rslora and (self.rank_pattern or self.alpha_pattern):
            raise ValueError("LoraConfig: use_rslora with rank_pattern or alpha_pattern is refused (as PEFT does)")
        if self.target_modules is None and not self.target_parameters:
            raise ValueError(
                "LoraConfig needs target_modules (nn.Linear layers, e.g. ['q_proj', 'v_proj']) and/or "
                "target_parameters (fused expert weights, e.g. ['mlp.experts.gate_up_proj'])"
            )
        for name in self.target_modules if isinstance(self.target_modules, tuple) else ():
            if not isinstance(name, str) or not name:
                raise ValueError(f"LoraConfig.target_modules holds {name!r}; every entry must be a module name")
        for name in self.target_parameters:
            if not isinstance(name, str) or not name:
                raise ValueError(f"LoraConfig.target_parameters holds {name!r}; every entry must be a parameter name")

    @classmethod
    def from_peft_dict(cls, raw: Mapping[str, Any], *, where: str = ADAPTER_CONFIG) -> LoraConfig:
        """A PEFT ``adapter_config.json``'s dict; anything but a LoRA adapter raymoe can run is a ValueError."""
        peft_type = raw.get("peft_type", "LORA")
        if peft_type != "LORA":
            raise ValueError(f"{where}: peft_type={peft_type!r}; raymoe loads LoRA adapters only")
        fields = {key: value for key, value in raw.items() if key not in _METADATA}
        try:
            return cls(**fields)
        except ValueError as error:
            raise ValueError(f"{where}: {error}") from None

    def to_peft_dict(self, base_model_name_or_path: str | None) -> dict[str, Any]:
        """The ``adapter_config.json`` PEFT writes for this adapter (every field it reads, at its meaning here)."""
        modules = list(self.target_modules) if isinstance(self.target_modules, tuple) else self.target_modules
        return {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": base_model_name_or_path,
            "r": self.r,
            "lora_alpha": self.lora_alpha,
            "target_modules": modules,
            "target_parameters": list(self.target_parameters) or None,
            "rank_pattern": dict(self.rank_pattern),
            "alpha_pattern": dict(self.alpha_pattern),
            "use_rslora": self.use_rslora,
            "lora_dropout": self.lora_dropout,
            "init_lora_weights": self.init_lora_weights,
            "bias": self.bias,
            "inference_mode": True,
            **{
                key: (dict(value) if isinstance(value, dict) else value) for key, value in _UNSUPPORTED_DEFAULTS.items()
            },
        }


@dataclass(frozen=True)
class LoraSpec:
    """The resolved request the ranks carry out: ``targets`` get adapters, read from ``adapter_dir`` (an absolute
    PEFT directory) or initialised per ``config.init_lora_weights`` from ``seed`` (the same values on every
    layout); the base is frozen."""

    config: LoraConfig
    targets: tuple[AdapterTarget, ...]
    adapter_dir: str | None = None
    seed: int = 0

    def factor_names(self) -> list[str]:
        return [name for target in self.targets for name in target.factor_names()]


def resolve_lora(
    request: LoraConfig | str | os.PathLike[str] | Mapping[str, Any], model: nn.Module, *, seed: int = 0
) -> LoraSpec:
    """The targets of ``request`` (a :class:`LoraConfig`, its dict, or a PEFT adapter directory) in ``model``
    (the meta model); every error names the field, the value and the rule."""
    adapter_dir: str | None = None
    if isinstance(request, str | os.PathLike):
        adapter_dir, config = read_adapter_config(request)
    elif isinstance(request, Mapping):
        config = LoraConfig(**request)
    elif isinstance(request, LoraConfig):
        config = request
    else:
        raise ValueError(f"lora={request!r} must be a raymoe.LoraConfig, its dict, or the directory of a PEFT adapter")
    config = expert_names_as_parameters(config, str(getattr(model, "model_type", "")))
    targets = _module_targets(config, model) + _parameter_targets(config, model)
    return LoraSpec(config=config, targets=tuple(targets), adapter_dir=adapter_dir, seed=seed)


# Families whose experts were nn.Linear modules per expert in transformers 4 and are fused 3-D parameters now: PEFT
# reads those old module names in target_modules as the fused parameters (gate and up together, at twice the rank
# and alpha, so alpha / r and the update are unchanged), and so does raymoe, so one LoraConfig means one adapter.
_QWEN2_MOE_NAMES = {"gate_proj": "gate_up_proj", "up_proj": "gate_up_proj", "down_proj": "down_proj"}
_V4_EXPERT_NAMES: dict[str, dict[str, str]] = {
    "mixtral": {"w1": "gate_up_proj", "w3": "gate_up_proj", "w2": "down_proj"},
    **{family: _QWEN2_MOE_NAMES for family in ("qwen2_moe", "qwen3_moe", "deepseek_v3", "glm4_moe")},
}


def expert_names_as_parameters(config: LoraConfig, model_type: str) -> LoraConfig:
    """``config`` with the transformers-4 expert module names of ``model_type`` in ``target_modules`` moved to
    ``target_parameters`` (as PEFT does on transformers 5); a gate or up half without the other is a ValueError."""
    names = _V4_EXPERT_NAMES.get(model_type)
    if not names or not isinstance(config.target_modules, tuple):
        return config
    modules, params, halves = [], list(config.target_parameters), set()
    for entry in config.target_modules:
        old = next((name for name in names if _suffix_match(entry, name)), None)
        if old is None:
            modules.append(entry)
            continue
        params += [names[old]] if names[old] not in params else []
        halves |= {old} if names[old] == "gate_up_proj" else set()
    fused = {old for old, new in names.items() if new == "gate_up_proj"}
    rank_pattern, alpha_pattern = dict(config.rank_pattern), dict(config.alpha_pattern)
    if halves and halves != fused:
        raise ValueError(
            f"LoraConfig.target_modules names {sorted(halves)} but not {sorted(fused - halves)}: on {model_type} they "
            "are one fused expert weight (gate_up_proj); name both, or target_parameters=['mlp.experts.gate_up_proj']"
        )
    if halves:
        rank_pattern[r".*\.gate_up_proj"] = config.r * len(fused)
        alpha_pattern[r".*\.gate_up_proj"] = config.lora_alpha * len(fused)
    return dataclasses.replace(
        config,
        target_modules=tuple(modules) if modules else None,
        target_parameters=tuple(params),
        rank_pattern=rank_pattern,
        alpha_pattern=alpha_pattern,
    )


def read_adapter_config(directory: str | os.PathLike[str]) -> tuple[str, LoraConfig]:
    """``(absolute directory, its LoraConfig)`` of a PEFT adapter directory; a clear error when it is not one."""
    import json

    path = Path(directory).expanduser()
    if "://" in str(directory):
        raise ValueError(f"lora={str(directory)!r}: an adapter must be a local directory (no URLs yet)")
    if not path.is_dir():
        raise ValueError(
            f"lora={str(directory)!r} is not a directory (a PEFT adapter directory holds {ADAPTER_CONFIG})"
        )
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        if not (path / name).is_file():
            raise ValueError(
                f"lora={str(directory)!r}: {name} is missing (PEFT writes {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS})"
            )
    raw = json.loads((path / ADAPTER_CONFIG).read_text())
    return str(path.absolute()), LoraConfig.from_peft_dict(raw, where=str(path / ADAPTER_CONFIG))


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"LoraConfig.{name}={value!r} must be an int >= 1")


def _positive_number(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ValueError(f"LoraConfig.{name}={value!r} must be a number > 0")


def _refuse_unsupported(fields: Mapping[str, Any]) -> None:
    for name, value in fields.items():
        if name not in _UNSUPPORTED_DEFAULTS:
            known = [*_UNSUPPORTED_DEFAULTS, *_KNOWN_FIELDS]
            near = difflib.get_close_matches(name, known, n=3)
            hint = f"; did you mean {', '.join(near)}?" if near else ""
            raise ValueError(f"LoraConfig has no field {name!r}{hint}")
        default = _UNSUPPORTED_DEFAULTS[name]
        if value != default and not (default in (None, False) and value in (None, False, {}, [])):
            raise ValueError(
                f"LoraConfig.{name}={value!r} is not supported by raymoe (PEFT's option); leave it at {default!r}"
            )


_KNOWN_FIELDS = (
    "r",
    "lora_alpha",
    "target_modules",
    "target_parameters",
    "rank_pattern",
    "alpha_pattern",
    "use_rslora",
    "lora_dropout",
    "init_lora_weights",
    "bias",
    "lora_dtype",
)


def _shape(config: LoraConfig, key: str, *, dropout: float) -> AdapterShape:
    rank_key = _pattern_key(config.rank_pattern, key)
    r = config.rank_pattern[rank_key] if rank_key else config.r
    alpha_key = _pattern_key(config.alpha_pattern, key)
    alpha = config.alpha_pattern[alpha_key] if alpha_key else config.lora_alpha
    return AdapterShape(r=r, scaling=scaling_of(r, alpha, config.use_rslora), dropout=dropout)


def _pattern_key(patterns: Mapping[str, Any], key: str) -> str | None:
    """The first pattern whose regular expression matches the end of ``key`` at a ``.`` boundary (PEFT's rule)."""
    for pattern in patterns:
        if re.match(rf"(.*\.)?({pattern})$", key):
            return pattern
    return None


def _suffix_match(name: str, entry: str) -> bool:
    return name == entry or name.endswith(f".{entry}")


def _module_targets(config: LoraConfig, model: nn.Module) -> list[AdapterTarget]:
    if config.target_modules is None:
        return []
    modules = dict(model.named_modules())
    if config.target_modules == "all-linear":
        chosen = [name for name, m in modules.items() if type(m) is nn.Linear and name.rpartition(".")[2] != "lm_head"]
    elif isinstance(config.target_modules, str):
        chosen = [name for name in modules if name and re.fullmatch(config.target_modules, name)]
        if not chosen:
            raise ValueError(f"LoraConfig.target_modules={config.target_modules!r} matches no module of the model")
    else:
        chosen = []
        for entry in config.target_modules:
            hits = [name for name in modules if name and _suffix_match(name, entry)]
            if not hits:
                raise ValueError(
                    f"LoraConfig.target_modules entry {entry!r} matches no module of the model"
                    f"{_nearest(entry, modules)}"
                )
            chosen += [name for name in hits if name not in chosen]
    targets = []
    for name in sorted(chosen, key=list(modules).index):
        module = modules[name]
        if type(module) is not nn.Linear:
            raise ValueError(
                f"LoraConfig.target_modules: {name} is a {type(module).__name__}, not an nn.Linear; LoRA on modules "
                "applies to linear layers (fused expert weights go in target_parameters, e.g. "
                "'mlp.experts.gate_up_proj')"
            )
        targets.append(AdapterTarget(name, None, _shape(config, name, dropout=config.lora_dropout)))
    return targets


def _parameter_targets(config: LoraConfig, model: nn.Module) -> list[AdapterTarget]:
    targets: list[AdapterTarget] = []
    params = {name: None for name, _ in model.named_parameters()}
    for entry in config.target_parameters:
        hits = [name for name in params if _suffix_match(name, entry)]
        if not hits:
            raise ValueError(
                f"LoraConfig.target_parameters entry {entry!r} matches no parameter of the model"
                f"{_nearest(entry, params)}"
            )
        for name in hits:
            module_name, _, param_name = name.rpartition(".")
            module = model.get_submodule(module_name)
            weight = module._parameters[param_name]
            if weight is None or weight.ndim != 3 or not getattr(module, EXPERT_BATCHED_ATTR, False):
                raise ValueError(
                    f"LoraConfig.target_parameters: {name} {tuple(weight.shape) if weight is not None else ''} is not "
                    "a "
                    "fused expert weight [E, out, in]; target_parameters applies to those (linear layers go in "
                    "target_modules)"
                )
            if config.lora_dropout:
                raise ValueError(
                    f"LoraConfig.lora_dropout={config.lora_dropout} with target_parameters ({name}): dropout cannot be "
                    "applied to an expert weight's update (PEFT refuses it too); set lora_dropout=0"
                )
            targets.append(AdapterTarget(module_name, param_name, _shape(config, name, dropout=0.0)))
    # Expert weights in the order their module registers them: PEFT nests several on one module in that order.
    order = list(params)
    return sorted({t.key: t for t in targets}.values(), key=lambda t: order.index(t.key))


def _nearest(entry: str, names: Mapping[str, Any]) -> str:
    """``; the nearest names are ...`` among the leaf-most parts of ``names`` (layer indices folded away)."""
    leaves = sorted({re.sub(r"\.\d+\.", ".*.", name) for name in names if name})
    tails = sorted({".".join(name.split(".")[-k:]) for name in leaves for k in (1, 2, 3)})
    near = difflib.get_close_matches(entry, tails, n=3, cutoff=0.5)
    return f"; the nearest names are {', '.join(near)}" if near else ""


def add_adapters(model: nn.Module, spec: LoraSpec) -> None:
    """Give ``model`` (any device, typically meta) the factors of every target of ``spec`` present in it (a pipeline
    stage's part holds some layers only) and freeze everything else."""
    modules = dict(model.named_modules())
    for target in spec.targets:
        module = modules.get(target.module)
        if module is None:
            continue
        if target.param is None:
            assert isinstance(module, nn.Linear)
            add_linear_adapter(module, target.shape)
        else:
            add_expert_adapter(module, target.param, target.shape)
    freeze_base(model)


def default_targets(model: nn.Module) -> tuple[list[str], list[str]]:
    """``(target_modules, target_parameters)`` of the default adapters, read from ``model`` (the meta model; a target
    that matches nothing is an error): every linear layer of the attention, by its name (q_proj, k_proj, v_proj,
    o_proj; DeepSeek-V3's MLA: q_proj or q_a_proj and q_b_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj), and the
    fused expert weights of a MoE model (mlp.experts.gate_up_proj, mlp.experts.down_proj; a dense model has none).
    What ``examples/finetune.py`` and ``raymoe plan`` adapt when no targets are given."""
    linear = [name for name, module in model.named_modules() if type(module) is nn.Linear]
    modules: list[str] = []
    for name in linear:
        leaf = name.rpartition(".")[2]
        if ".self_attn." in name and leaf not in modules:
            modules.append(leaf)
    # A leaf name that a linear layer outside the attention has too would adapt that one as well: qualified then.
    modules = [
        leaf if all(".self_attn." in name for name in linear if name.endswith(f".{leaf}")) else f"self_attn.{leaf}"
        for leaf in modules
    ]
    parameters: list[str] = []
    for name, param in model.named_parameters():
        module_name, _, _ = name.rpartition(".")
        if param.ndim == 3 and getattr(model.get_submodule(module_name), EXPERT_BATCHED_ATTR, False):
            entry = re.sub(r"^(.*\.)?\d+\.", "", name)  # model.layers.0.mlp.experts.down_proj -> mlp.experts.down_proj
            if entry not in parameters:
                parameters.append(entry)
    return modules, parameters


def is_expert_weight(name: str) -> bool:
    """A target name of a fused expert weight: one with an ``experts.`` part (``mlp.experts.down_proj``; not
    ``mlp.shared_experts.down_proj``, a linear layer)."""
    return re.search(r"(^|\.)experts\.[^.]+$", name) is not None


def lora_config_of(
    model: nn.Module, r: int, alpha: float | None = None, targets: Sequence[str] | None = None
) -> LoraConfig:
    """The adapters of a command line (``finetune.py``'s and ``raymoe plan``'s ``--lora-r``, ``--lora-alpha``,
    ``--lora-targets``): ``targets`` split into linear layers and fused expert weights (:func:`is_expert_weight`;
    None: :func:`default_targets` of ``model``, the meta model), ``alpha`` None: ``2 * r``."""
    if targets is None:
        modules, parameters = default_targets(model)
    else:
        modules = [name for name in targets if not is_expert_weight(name)]
        parameters = [name for name in targets if is_expert_weight(name)]
    return LoraConfig(
        r=r,
        lora_alpha=alpha if alpha is not None else 2 * r,
        target_modules="all-linear" if modules == ["all-linear"] else (modules or None),
        target_parameters=parameters,
    )
