"""Plan resolution: a model's default plans + the user's overrides -> the style of every module (SPEC §3).

Runs on the driver against the model built on the meta device, before any actor starts and
before any weight is read. Nothing is applied here: the result is a plain description that
the rank actors apply later, so a bad plan fails whole and nothing is half-applied.

    default plans (model)      overrides (DistributedConfig)
            \\                        /
             merge (PLAN-3), keys checked against the model (PLAN-4)
                          |
             expand '*' to concrete module / parameter paths
                          |
             tp active iff tp_size > 1, ep active iff ep_size > 1 (PLAN-5)
             EP wins over TP on the same paths and their children (PLAN-5)
             a TOKEN_DISPATCH experts style -> dispatch, router mask ignored (PLAN-6)
                          |
             validate_param of every style on every parameter it covers
                          |
                    ResolvedPlans (rules + the style instances they name, shipped to every rank)

What a style does in expert parallelism is read from its type (``ParallelStyle.expert_role``,
``shards_experts``), never from its name, so a user's EP style under any name is handled like
the built-in one it resembles.

Keys are module or parameter paths as seen from the loaded model, with ``*`` standing for a
layer index (``model.layers.*.mlp.gate``). A key written without the base-model prefix
(``layers.*.mlp.gate``), or with it on a base model, is accepted when exactly one spelling
matches.
"""

from __future__ import annotations

import difflib
import logging
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cache
from typing import Literal

from torch import nn

from raymoe.models.common.lora import lora_factors
from raymoe.models.common.plans import SEQUENCE_PARALLEL_TP, DefaultPlans
from raymoe.parallel.styles import STYLES, ExpertRole, ParallelStyle, check_style_name
from raymoe.spec.config import DistributedConfig, ExpertMode

logger = logging.getLogger(__name__)

PlanKind = Literal["tp", "ep", "fsdp"]

# FSDP2 plan values: free the gathered weight after forward (re-gather for backward), or keep it.
FSDP_STRATEGIES = ("free_full_weight", "keep_full_weight")


@dataclass(frozen=True)
class ResolvedPlans:
    """What to apply where.

    ``*_plan`` are the merged plans (defaults + overrides, wildcard keys) the model exposes as
    ``model.tp_plan`` etc. ``*_rules`` map concrete module/parameter paths to the style that
    is applied there: empty for a kind that is inactive, TP rules under EP targets removed,
    the router mask dropped under token dispatch. ``styles`` holds the instance of every style
    name the rules use, taken from the driver's registry when the plans were resolved.
    ``expert_modules`` are the modules that hold expert weights under EP: those whose parameters
    an ep rule's style shards along the expert dim (``shards_experts``).
    """

    tp_plan: dict[str, str]
    ep_plan: dict[str, str]
    fsdp_plan: dict[str, str]
    tp_rules: dict[str, str]
    ep_rules: dict[str, str]
    fsdp_rules: dict[str, str]
    expert_mode: ExpertMode
    styles: dict[str, ParallelStyle] = field(default_factory=dict)
    expert_modules: tuple[str, ...] = ()


def resolve_plans(
    model: nn.Module,
    defaults: DefaultPlans,
    config: DistributedConfig,
    *,
    num_experts: int | None = None,
    registry: Mapping[str, ParallelStyle] = STYLES,
) -> ResolvedPlans:
    """Merge, check and expand the plans of ``model`` (meta device is fine) for ``config``.

    ``num_experts`` is the model's expert count (None for a dense model). ``registry`` maps style
    names to instances (default: the driver's, with every style the user registered). Every problem
    is a ``ValueError`` raised before anything is sharded.
    """
    if config.tp_size is None:
        raise ValueError("resolve_plans needs a resolved config (tp_size is deferred); call config.resolve(world_size)")
    names = _ModelNames(model)
    tp_active, ep_active = config.tp_size > 1, (config.ep_size or 1) > 1

    default_tp = {**defaults.tp, **SEQUENCE_PARALLEL_TP} if config.enable_sequence_parallel else defaults.tp
    tp_plan = _merge("tp", default_tp, config.tp_plan, names)
    ep_plan = _merge("ep", defaults.ep, config.ep_plan, names)
    fsdp_plan = _merge("fsdp", defaults.fsdp, config.fsdp_plan, names)
    _check_styles("tp", _overrides(config.tp_plan), registry)  # bad input fails even where unused
    _check_styles("ep", _overrides(config.ep_plan), registry)
    _check_fsdp_strategies(fsdp_plan)

    ep_rules = _expand("ep", ep_plan, names) if ep_active else {}
    _check_styles("ep", ep_rules, registry)
    expert_mode = _expert_mode(ep_rules, ep_active, registry)
    if ep_active:
        _check_experts(config, expert_mode, num_experts)
    if expert_mode == "dispatch":
        # PLAN-6: dispatch routes with global expert ids, so a router mask must not apply.
        ep_rules = {p: s for p, s in ep_rules.items() if registry[s].expert_role is not ExpertRole.ROUTER_MASK}
    tp_rules = _expand("tp", tp_plan, names) if tp_active else {}
    tp_rules = {path: style for path, style in tp_rules.items() if not _under_any(path, ep_rules)}
    _check_styles("tp", tp_rules, registry)
    fsdp_rules = _expand("fsdp", fsdp_plan, names)
    _check_fsdp_targets(fsdp_rules, names)

    if tp_active:  # without TP every dense parameter is whole by design; only TP leaves surprises
        _warn_uncovered(names.params, {**tp_rules, **ep_rules})
    _validate_params(model, "tp", tp_rules, config.tp_size, registry)
    _validate_params(model, "ep", ep_rules, config.ep_size or 1, registry)
    styles = {name: registry[name] for name in sorted({*tp_rules.values(), *ep_rules.values()})}
    return ResolvedPlans(
        tp_plan,
        ep_plan,
        fsdp_plan,
        tp_rules,
        ep_rules,
        fsdp_rules,
        expert_mode,
        styles=styles,
        expert_modules=_expert_modules(ep_rules, styles, names),
    )


# --- names and key matching --------------------------------------------------------------------


class _ModelNames:
    """Module and parameter paths of a model, and wildcard matching against them."""

    def __init__(self, model: nn.Module) -> None:
        self.model_class = type(model).__name__
        self.prefix = str(getattr(model, "base_model_prefix", "model"))
        self.modules = [name for name, _ in model.named_modules() if name]
        self.params = [name for name, _ in model.named_parameters(remove_duplicate=False)]
        self.module_set = set(self.modules)
        self.all = self.modules + self.params

    def match(self, key: str) -> list[str]:
        pattern = _key_pattern(key)
        return [name for name in self.all if pattern.fullmatch(name)]

    def spellings(self, key: str) -> list[str]:
        """The key as written, and with the base-model prefix added or removed."""
        head = f"{self.prefix}."
        other = key.removeprefix(head) if key.startswith(head) else head + key
        return [key, other]

    def normalise(self, kind: PlanKind, key: str) -> str | None:
        """The one spelling of ``key`` that matches the model, or None when none does."""
        hits = [spelling for spelling in self.spellings(key) if self.match(spelling)]
        if len(hits) > 1:
            raise ValueError(
                f"{kind}_plan key {key!r} is ambiguous on {self.model_class}: both {hits[0]!r} and {hits[1]!r} "
                "match; write the full path [PLAN-2]"
            )
        return hits[0] if hits else None

    def suggestions(self, key: str) -> list[str]:
        wildcarded = sorted({_wildcard(name) for name in self.all})
        return difflib.get_close_matches(key, wildcarded, n=3, cutoff=0.5)


@cache
def _key_pattern(key: str) -> re.Pattern[str]:
    return re.compile(r"\.".join(r"\d+" if part == "*" else re.escape(part) for part in key.split(".")))


def _wildcard(path: str) -> str:
    return ".".join("*" if part.isdigit() else part for part in path.split("."))


def _under_any(path: str, targets: Mapping[str, str]) -> bool:
    """True when ``path`` is one of ``targets`` or lies beneath one (a child module or parameter)."""
    parts = path.split(".")
    return any(".".join(parts[:i]) in targets for i in range(1, len(parts) + 1))


# --- merge (PLAN-3, PLAN-4) --------------------------------------------------------------------


def _merge(
    kind: PlanKind, defaults: Mapping[str, str], override: Mapping[str, str] | str | None, names: _ModelNames
) -> dict[str, str]:
    merged = {names.normalise(kind, key) or key: style for key, style in defaults.items()}
    if override is None or override == "auto":
        return merged
    assert isinstance(override, Mapping)  # DistributedConfig admits only dict, "auto" or None
    if kind == "tp" and not override:
        return {}  # tp_plan={} means no TP rules at all (SPEC §1)
    unmatched = []
    for key, style in override.items():
        normalised = names.normalise(kind, key) or next((s for s in names.spellings(key) if s in merged), None)
        if normalised is None:
            unmatched.append(key)
        else:
            merged[normalised] = style
    if unmatched:
        raise ValueError(_unmatched_message(kind, unmatched, names))
    return merged


def _unmatched_message(kind: PlanKind, keys: list[str], names: _ModelNames) -> str:
    lines = [
        f"{kind}_plan override keys match no module, parameter or {kind}_plan entry of {names.model_class} "
        f"(each key was tried as written and with the '{names.prefix}.' prefix added or removed) [PLAN-4]:"
    ]
    for key in keys:
        close = names.suggestions(key)
        hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        lines.append(f"  {key!r}{hint}")
    lines.append("Keys are paths as seen from the loaded model, '*' standing for a layer index.")
    return "\n".join(lines)


def _overrides(plan: Mapping[str, str] | str | None) -> Mapping[str, str]:
    return plan if isinstance(plan, Mapping) else {}


def _check_styles(kind: PlanKind, rules: Mapping[str, str], registry: Mapping[str, ParallelStyle]) -> None:
    """One error for all unavailable styles, each named once with the first rule that uses it."""
    first_use = {style: key for key, style in reversed(list(rules.items()))}
    problems = []
    for style, key in sorted(first_use.items()):
        try:
            check_style_name(registry, style, where=f"{kind}_plan[{key!r}]")
        except ValueError as exc:
            problems.append(str(exc))
    if problems:
        raise ValueError("\n".join(problems))


def _check_fsdp_strategies(plan: Mapping[str, str]) -> None:
    bad = {key: style for key, style in plan.items() if style not in FSDP_STRATEGIES}
    if bad:
        raise ValueError(f"fsdp_plan values must be one of {FSDP_STRATEGIES}, got {bad} [PLAN-4]")


# --- expansion and precedence (PLAN-5, PLAN-6) ------------------------------------------------


def _expand(kind: PlanKind, plan: Mapping[str, str], names: _ModelNames) -> dict[str, str]:
    """Concrete path -> style. Exact keys beat wildcard keys on the same path."""
    rules: dict[str, str] = {}
    ordered = sorted(plan.items(), key=lambda item: "*" not in item[0])  # wildcards first
    for key, style in ordered:
        matched = names.match(key)
        if not matched:
            logger.warning("%s_plan rule %r -> %r matched nothing in %s [PLAN-4]", kind, key, style, names.model_class)
        rules.update(dict.fromkeys(matched, style))
    return rules


def _expert_mode(ep_rules: Mapping[str, str], ep_active: bool, registry: Mapping[str, ParallelStyle]) -> ExpertMode:
    if not ep_active:
        return "none"
    roles = [registry[style].expert_role for style in ep_rules.values()]
    if ExpertRole.TOKEN_DISPATCH in roles:
        return "dispatch"
    routers, experts = roles.count(ExpertRole.ROUTER_MASK), roles.count(ExpertRole.EXPERTS_PARTIAL_SUM)
    if routers and routers == experts:
        return "masking"
    if routers or experts:
        raise ValueError(
            "masked expert parallelism needs a router-masking style (e.g. 'ep_router') on the router and a "
            "partial-sum experts style (e.g. 'moe_tp_experts') on the experts of every MoE layer; the ep_plan puts "
            f"them on {routers} routers and {experts} expert modules [PLAN-6]"
        )
    raise ValueError(
        "ep_size > 1 but the ep_plan selects no expert-parallel mechanism: add a token-dispatch style on the experts "
        "(e.g. 'ep_dispatch_experts') or 'ep_router' + 'moe_tp_experts' (masking) [PLAN-6]"
    )


def _expert_modules(
    ep_rules: Mapping[str, str], styles: Mapping[str, ParallelStyle], names: _ModelNames
) -> tuple[str, ...]:
    """Owners of the parameters whose ep style shards the expert dim: a module rule names the module itself."""
    owners = {
        path if path in names.module_set else path.rpartition(".")[0]
        for path, style in ep_rules.items()
        if styles[style].shards_experts
    }
    return tuple(sorted(owners))


def _check_experts(config: DistributedConfig, mode: ExpertMode, num_experts: int | None) -> None:
    if num_experts is None:
        raise ValueError(f"ep_size={config.ep_size} but the model has no experts; leave ep_size unset [CFG-3]")
    if num_experts % (config.ep_size or 1):
        raise ValueError(f"ep_size={config.ep_size} must divide the model's num_experts={num_experts} [CFG-3]")
    config.check_expert_mode(mode)


def _check_fsdp_targets(rules: Mapping[str, str], names: _ModelNames) -> None:
    params = sorted(path for path in rules if path not in names.module_set)
    if params:
        raise ValueError(f"fsdp_plan keys must name modules, but these are parameters: {params} [PLAN-4]")


def _warn_uncovered(params: Iterable[str], rules: Mapping[str, str]) -> None:
    uncovered = sorted({_wildcard(p) for p in params if not _under_any(p, rules)})
    if uncovered:
        shown = ", ".join(uncovered[:8]) + (f", … (+{len(uncovered) - 8} more)" if len(uncovered) > 8 else "")
        logger.warning("%d parameter paths are covered by no plan rule and stay replicated: %s", len(uncovered), shown)


# --- validate_param (STYLE-1) ------------------------------------------------------------------


def _validate_params(
    model: nn.Module, kind: PlanKind, rules: Mapping[str, str], mesh_size: int, registry: Mapping[str, ParallelStyle]
) -> None:
    """Each style checks every parameter it covers: a module rule its direct parameters, a parameter rule that one."""
    for path, style_name in rules.items():
        style = registry[style_name]
        module_path, _, leaf = path.rpartition(".")
        owner = model.get_submodule(module_path)
        if isinstance(getattr(owner, leaf, None), nn.Parameter):
            # a LoRA factor of the weight follows the weight's rule (raymoe.parallel.apply)
            factors = [name for name, (base, _) in lora_factors(owner).items() if base == leaf]
            targets = [(owner, name, getattr(owner, name)) for name in (leaf, *factors)]
        else:
            module = model.get_submodule(path)
            targets = [(module, name, param) for name, param in module.named_parameters(recurse=False)]
        for module, name, param in targets:
            try:
                style.validate_param(module, name, param, mesh_size)
            except ValueError as exc:
                raise ValueError(
                    f"{kind}_plan rule {path!r} -> {style_name!r} cannot shard {name} "
                    f"{tuple(param.shape)} over {kind}_size={mesh_size}: {exc}"
                ) from None
