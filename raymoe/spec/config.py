"""DistributedConfig: the parallel layout a user asks for (SPEC §1, rules CFG-1…CFG-9).

The config is validated and normalised when it is built, on the driver, before any actor
exists. Every rule violation is a ``ValueError`` naming the fields, their values and the rule.

Sizes after normalisation::

    world_size = dp_replicate_size * fsdp_size * cp_size * tp_size * pp_size   (CFG-1)
    dp_size    = dp_replicate_size * fsdp_size                                  distinct batches
    efsdp_size = fsdp_size * cp_size * tp_size / ep_size                        copies of the expert set

``cp_size`` (context parallelism) splits every sequence of a batch over ``cp_size`` ranks; they hold the same rows
(one batch), each a ``1/cp_size`` share of its tokens (:mod:`raymoe.parallel.context_parallel`). FSDP2 shards the
parameters over ``fsdp_size * cp_size`` ranks, and expert parallelism may span the cp ranks too.

Decisions where the reference design is ambiguous or broken:

* ``tp_size=None`` with ``tp_plan="auto"`` is *deferred*: the tensor-parallel degree becomes
  ``world_size // (dp_replicate_size * fsdp_size * pp_size)`` once the world size is known
  (:meth:`DistributedConfig.resolve`). A plan given as an override dict never infers a size
  (CFG-7): its size must be set explicitly, otherwise the override would be silently dropped.
* ``enable_expert_parallel=True`` without ``ep_size`` means ``ep_size=tp_size, tp_plan={}``
  (CFG-6): the ``tp_size`` ranks of a group become one expert-parallel group, experts are
  sharded over it, and the dense modules stay whole on every rank of the group. The flag
  needs ``tp_size > 1`` (otherwise it would do nothing). After the translation the flag
  reads ``False``: ``ep_size`` and ``tp_plan`` carry its whole meaning, so a round trip
  through ``to_dict``/``from_dict`` is exact and warns once, not twice.
"""

from __future__ import annotations

import json
import sys
import warnings
from types import FrameType
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictStr, ValidationError, field_validator

from raymoe.parallel.context_parallel import ContextParallelMode
from raymoe.parallel.context_parallel.chunks import check_splittable
from raymoe.parallel.styles import STYLES, ExpertRole
from raymoe.spec.reshard import ReshardChoice

PlanDict = dict[StrictStr, StrictStr]

# Pipeline schedules (torch.distributed.pipelining's GPipe, 1F1B, Interleaved1F1B).
PipelineScheduleName = Literal["gpipe", "1f1b", "interleaved_1f1b"]

# Expert-parallel mechanisms a resolved ep_plan can select (SPEC §5; chosen in spec/plans.py).
ExpertMode = Literal["none", "masking", "dispatch"]


def _rule_error(rule: str, message: str) -> ValueError:
    return ValueError(f"DistributedConfig: {message} [{rule}]")


def _readable(exc: ValidationError) -> ValueError:
    """One plain ValueError per failed construction: field, value and rule, no pydantic boilerplate."""
    lines = []
    for err in exc.errors(include_url=False):
        field = ".".join(str(part) for part in err["loc"])
        message = err["msg"].removeprefix("Value error, ")
        if err["type"] == "value_error":
            lines.append(message)
        else:
            lines.append(f"DistributedConfig: {field}={err['input']!r}: {message}")
    return ValueError("\n".join(lines))


def _caller_stacklevel() -> int:
    """Stack level of the first frame outside this module and pydantic, so warnings point at user code."""
    frame: FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None and (frame.f_code.co_filename == __file__ or "pydantic" in frame.f_code.co_filename):
        frame, level = frame.f_back, level + 1
    return level


class DistributedConfig(BaseModel):
    """How a model is split over ranks. Sizes left as ``None`` get the CFG-2 defaults."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    tp_size: int | None = Field(default=None, ge=1, description="tensor-parallel degree")
    tp_plan: PlanDict | Literal["auto"] | None = Field(
        default=None, description='TP plan override; "auto"/None = model default; {} = no TP rules'
    )
    enable_sequence_parallel: bool = Field(
        default=False,
        description="Megatron-style sequence parallelism inside TP: norms and the residual stream split along the "
        "sequence over the tp group (CFG-9; needs tp_size > 1)",
    )
    enable_expert_parallel: bool = Field(default=False, description="deprecated (CFG-6); use ep_size")
    fsdp_size: int | None = Field(default=None, ge=1, description="FSDP2 shard degree")
    dp_replicate_size: int | None = Field(default=None, ge=1, description="HSDP replica count")
    fsdp_plan: PlanDict | None = Field(default=None, description="FSDP2 plan override")
    fsdp_cpu_offload: bool = Field(default=False, description="FSDP2 CPU offload")
    fsdp_mixed_precision: bool = Field(
        default=False, description="FSDP2 bf16 params, fp32 reduce: from_pretrained's precision='bf16-mixed'"
    )
    fsdp_defer_gradient_sync: bool = Field(
        default=False,
        description="gradient accumulation without a reduce-scatter per micro-batch: full unsharded gradients are "
        "kept until the last one (one reduction a step, a whole model's gradients of memory more per rank)",
    )
    fsdp_reshard_after_forward: ReshardChoice = Field(
        default="auto",
        description="whether FSDP2 units free their gathered weights after forward and gather them again in backward: "
        "'always' (the fsdp_plan's strategies), 'never' (every unit keeps them until its backward: one all-gather a "
        "step instead of two, the gathered model's memory more), 'auto' ('never' where the gathered weights take at "
        "most 1/8 of the device memory free at load, else 'always' with the last decoder layer kept); "
        "raymoe.spec.reshard",
    )
    activation_checkpointing: Literal["none", "full", "selective"] = Field(
        default="none",
        description="recompute each decoder layer's activations in backward: all of them (full), or all but the "
        "matmul and attention outputs (selective)",
    )
    cp_size: int | None = Field(
        default=None, ge=1, description="context-parallel degree: ranks that split every sequence of a batch"
    )
    cp_mode: ContextParallelMode = Field(
        default="ring",
        description="attention across the split (cp_size > 1): 'ring' (K/V passed around the cp ranks) or "
        "'all_to_all' (Ulysses: sequence <-> heads; needs heads divisible by cp_size)",
    )
    pp_size: int | None = Field(default=None, ge=1, description="pipeline degree")
    pp_schedule: PipelineScheduleName = Field(
        default="1f1b", description="pipeline schedule: 'gpipe', '1f1b' or 'interleaved_1f1b' (pp_size > 1)"
    )
    pp_microbatches: int | None = Field(
        default=None, ge=1, description="micro-batches of each rank's rows per pipeline step (default: pp_size)"
    )
    pp_stages_per_rank: int | None = Field(
        default=None, ge=1, description="model chunks each pipeline rank holds (interleaved_1f1b: default 2; else 1)"
    )
    pp_split: list[int] | None = Field(
        default=None,
        description="first decoder layer of every stage after the first (default: balanced by parameter count)",
    )
    ep_size: int | None = Field(default=None, ge=1, description="expert-parallel degree")
    ep_plan: PlanDict | None = Field(default=None, description="EP plan override")

    @field_validator("tp_plan", "fsdp_plan", "ep_plan")
    @classmethod
    def _plan_keys_and_values_not_empty(cls, plan: Any) -> Any:
        if isinstance(plan, dict):
            for key, style in plan.items():
                if not key.strip() or not style.strip():
                    raise ValueError(f"plan entries need a non-empty key and style name, got {key!r}: {style!r}")
        return plan

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise _readable(exc) from None

    def model_post_init(self, context: Any, /) -> None:
        self._normalise()

    # --- normalisation (CFG-2, CFG-6, CFG-7, CFG-9, CFG-11) --------------------------------------

    def _set(self, field: str, value: Any) -> None:
        # The model is frozen for users; normalisation writes its derived defaults once, here.
        self.__dict__[field] = value

    def _normalise(self) -> None:
        self._translate_enable_expert_parallel()
        for field in ("dp_replicate_size", "fsdp_size", "cp_size", "pp_size"):
            if getattr(self, field) is None:
                self._set(field, 1)
        self._default_tp_size()
        self._default_ep_size()
        self._default_pipeline()
        self._check_context_parallel()
        if self.tp_size is not None:
            self._check_sizes(self.tp_size)
            self._check_sequence_parallel(self.tp_size)
        self._check_overridden_expert_mode()

    def _check_context_parallel(self) -> None:
        """CFG-11: ``cp_mode`` means something only with ``cp_size > 1``."""
        if self._cp == 1 and self.cp_mode != type(self).model_fields["cp_mode"].default:
            warnings.warn(
                f"cp_mode={self.cp_mode!r} is ignored because cp_size=1: it applies only when cp_size > 1 [CFG-11]",
                UserWarning,
                stacklevel=_caller_stacklevel(),
            )

    def _check_sequence_parallel(self, tp_size: int) -> None:
        """CFG-9: sequence parallelism splits the sequence over the tp group, so it needs one; not with pipelines."""
        if not self.enable_sequence_parallel:
            return
        if tp_size == 1:
            raise _rule_error(
                "CFG-9",
                "enable_sequence_parallel=True splits norms and the residual stream along the sequence over the tp "
                "group, but tp_size=1; set tp_size > 1 (to split sequences over ranks without TP, use cp_size)",
            )
        if self._pp > 1:
            raise _rule_error(
                "CFG-9",
                f"enable_sequence_parallel=True with pp_size={self.pp_size} is not implemented (pipeline stages pass "
                "whole-sequence activations); use pp_size=1, or cp_size to split sequences over ranks with pipelines",
            )

    def _translate_enable_expert_parallel(self) -> None:
        if not self.enable_expert_parallel:
            return
        if self.ep_size is not None:
            warnings.warn(
                f"enable_expert_parallel is deprecated and ignored here: ep_size={self.ep_size} is set explicitly "
                "and wins (CFG-6). Drop the flag.",
                FutureWarning,
                stacklevel=_caller_stacklevel(),
            )
        elif self.tp_size is None or self.tp_size == 1:
            raise _rule_error(
                "CFG-6",
                f"enable_expert_parallel=True without ep_size means ep_size=tp_size, but tp_size={self.tp_size}, "
                "so no expert would be sharded; set ep_size explicitly (enable_expert_parallel is deprecated)",
            )
        else:
            warnings.warn(
                f"enable_expert_parallel=True is deprecated: it means ep_size={self.tp_size}, tp_plan={{}} "
                f"(experts sharded over the {self.tp_size} ranks of each tp group, dense modules not sharded). "
                f"Write DistributedConfig(tp_size={self.tp_size}, ep_size={self.tp_size}, tp_plan={{}}) instead, "
                "or drop tp_plan to also shard the dense modules (CFG-6).",
                FutureWarning,
                stacklevel=_caller_stacklevel(),
            )
            self._set("ep_size", self.tp_size)
            if self.tp_plan is None:
                self._set("tp_plan", {})
        self._set("enable_expert_parallel", False)

    def _default_pipeline(self) -> None:
        """CFG-10: the pipeline options are defaulted and checked against pp_size and each other."""
        options = {
            name: getattr(self, name)
            for name in ("pp_microbatches", "pp_stages_per_rank", "pp_split")
            if getattr(self, name) is not None
        }
        if self.pp_schedule != "1f1b":
            options["pp_schedule"] = self.pp_schedule
        if self._pp == 1:
            if options:
                warnings.warn(
                    f"pipeline options {options} are ignored because pp_size=1: they apply only when pp_size > 1 "
                    "[CFG-10]",
                    UserWarning,
                    stacklevel=_caller_stacklevel(),
                )
            return
        interleaved = self.pp_schedule == "interleaved_1f1b"
        if self.pp_stages_per_rank is None:
            self._set("pp_stages_per_rank", 2 if interleaved else 1)
        if interleaved and self.stages_per_rank < 2:
            raise _rule_error(
                "CFG-10", f"pp_schedule='interleaved_1f1b' needs pp_stages_per_rank >= 2, got {self.pp_stages_per_rank}"
            )
        if not interleaved and self.stages_per_rank != 1:
            raise _rule_error(
                "CFG-10",
                f"pp_stages_per_rank={self.pp_stages_per_rank} needs pp_schedule='interleaved_1f1b'; "
                f"pp_schedule={self.pp_schedule!r} runs one stage per rank",
            )
        if self.pp_microbatches is None:
            self._set("pp_microbatches", self._pp)
        microbatches = self.pp_microbatches
        assert microbatches is not None  # defaulted above
        if self.pp_schedule != "gpipe" and microbatches < self._pp:
            raise _rule_error(
                "CFG-10",
                f"pp_microbatches={microbatches} must be at least pp_size={self.pp_size} for "
                f"pp_schedule={self.pp_schedule!r} (every stage needs a micro-batch in flight)",
            )
        if interleaved and microbatches % self._pp:
            raise _rule_error(
                "CFG-10",
                f"pp_microbatches={microbatches} must be a multiple of pp_size={self.pp_size} for "
                "pp_schedule='interleaved_1f1b'",
            )
        if self.pp_split is not None:
            split = self.pp_split
            if len(split) != self.num_stages - 1 or any(b <= a for a, b in zip([0, *split], split, strict=False)):
                raise _rule_error(
                    "CFG-10",
                    f"pp_split={split} must list {self.num_stages - 1} increasing layer indices above 0, the first "
                    f"layer of every stage after the first (pp_size * pp_stages_per_rank = {self.num_stages} stages)",
                )

    def _default_tp_size(self) -> None:
        if self.tp_size is not None:
            if self.tp_size == 1 and isinstance(self.tp_plan, dict) and self.tp_plan:
                warnings.warn(
                    "tp_plan overrides are ignored because tp_size=1: a TP plan applies only when tp_size > 1 [PLAN-5]",
                    UserWarning,
                    stacklevel=_caller_stacklevel(),
                )
            return
        if isinstance(self.tp_plan, dict) and self.tp_plan:
            raise _rule_error(
                "CFG-7",
                f"tp_plan overrides {sorted(self.tp_plan)} were given with tp_size=None; giving a plan never "
                "infers sizes: set tp_size explicitly (or use tp_plan='auto' to take tp_size from the world size)",
            )
        if self.tp_plan != "auto":
            self._set("tp_size", 1)
        # tp_plan="auto" with tp_size=None stays deferred until resolve(world_size) (CFG-2).

    def _default_ep_size(self) -> None:
        if self.ep_size is None:
            if self.ep_plan:
                raise _rule_error(
                    "CFG-7",
                    f"ep_plan overrides {sorted(self.ep_plan)} were given with ep_size=None; giving a plan never "
                    "infers sizes: set ep_size explicitly (an ep_plan applies only when ep_size > 1)",
                )
            self._set("ep_size", 1)
        elif self.ep_size == 1 and self.ep_plan:
            warnings.warn(
                "ep_plan overrides are ignored because ep_size=1: an EP plan applies only when ep_size > 1 [PLAN-5]",
                UserWarning,
                stacklevel=_caller_stacklevel(),
            )

    def _check_sizes(self, tp_size: int) -> None:
        """CFG-3 divisibility between ep, tp, cp and fsdp (number of experts is checked in plans.py)."""
        ep, fsdp, cp = self.ep_size, self.fsdp_size, self._cp
        assert ep is not None and fsdp is not None  # set by _normalise before this runs
        if ep == 1:
            return
        if ep % tp_size:
            raise _rule_error("CFG-3", f"ep_size={ep} must be a multiple of tp_size={tp_size}")
        if (fsdp * cp * tp_size) % ep:
            if cp == 1:
                raise _rule_error(
                    "CFG-3", f"ep_size={ep} must divide fsdp_size * tp_size = {fsdp} * {tp_size} = {fsdp * tp_size}"
                )
            raise _rule_error(
                "CFG-3",
                f"ep_size={ep} must divide fsdp_size * cp_size * tp_size = {fsdp} * {cp} * {tp_size} = "
                f"{fsdp * cp * tp_size}",
            )

    def _check_overridden_expert_mode(self) -> None:
        """CFG-4 / CFG-5 when the ep_plan override alone decides the EP mechanism.

        Styles are looked up in the driver's registry and judged by their type (``expert_role``);
        an unknown name is left for plan resolution to report (PLAN-4). A mechanism that comes from
        the model's default plan is checked when the config is bound to the model (``resolve_plans``).
        """
        if not self.ep_plan or (self.ep_size or 1) == 1:
            return
        roles = {STYLES[name].expert_role for name in self.ep_plan.values() if name in STYLES}
        if ExpertRole.TOKEN_DISPATCH in roles:
            mode: ExpertMode = "dispatch"
        elif {ExpertRole.ROUTER_MASK, ExpertRole.EXPERTS_PARTIAL_SUM} <= roles:
            mode = "masking"
        else:
            return
        if mode == "masking" and self.tp_size is None:
            return  # tp_size waits for the world size; checked when bound
        self.check_expert_mode(mode)

    # --- derived sizes --------------------------------------------------------------------------

    @property
    def tp_is_deferred(self) -> bool:
        """True while tp_size waits for the world size (tp_plan='auto', tp_size=None)."""
        return self.tp_size is None

    def _resolved_tp_size(self) -> int:
        if self.tp_size is None:
            raise ValueError(
                "DistributedConfig: tp_size=None with tp_plan='auto' is inferred from the world size; "
                "call config.resolve(world_size) first [CFG-2]"
            )
        return self.tp_size

    @property
    def world_size(self) -> int:
        """Number of ranks (CFG-1): ``dp_replicate_size * fsdp_size * cp_size * tp_size * pp_size``."""
        return self.dp_size * self._cp * self._resolved_tp_size() * self._pp

    @property
    def dp_size(self) -> int:
        """Ranks that each hold a distinct batch: ``dp_replicate_size * fsdp_size``."""
        assert self.dp_replicate_size is not None and self.fsdp_size is not None  # normalised
        return self.dp_replicate_size * self.fsdp_size

    @property
    def efsdp_size(self) -> int:
        """Full copies of the expert set inside one replica: ``fsdp_size * cp_size * tp_size / ep_size``."""
        assert self.fsdp_size is not None and self.ep_size is not None  # normalised
        return self.fsdp_size * self._cp * self._resolved_tp_size() // self.ep_size

    @property
    def _pp(self) -> int:
        assert self.pp_size is not None  # normalised
        return self.pp_size

    @property
    def _cp(self) -> int:
        assert self.cp_size is not None  # normalised
        return self.cp_size

    @property
    def splits_sequences(self) -> bool:
        """Context parallelism: each sequence of a batch is split over ``cp_size > 1`` ranks."""
        return self._cp > 1

    @property
    def stages_per_rank(self) -> int:
        """Model chunks (pipeline stages) each pipeline rank holds: 1 without pipelines."""
        return (self.pp_stages_per_rank or 1) if self._pp > 1 else 1

    @property
    def num_stages(self) -> int:
        """Pipeline stages of the model: ``pp_size * pp_stages_per_rank`` (1 without pipelines)."""
        return self._pp * self.stages_per_rank

    def check_sequence_length(self, length: int) -> None:
        """A ``ValueError`` unless rows of ``length`` tokens split over the cp ranks (``2 * cp_size`` equal chunks:
        the load-balanced split of :mod:`raymoe.parallel.context_parallel.chunks`) and, with sequence parallelism,
        each cp rank's share over the tp ranks; nothing to check without either."""
        if self.splits_sequences:
            check_splittable(length, self._cp)
        tp = self._resolved_tp_size()
        if self.enable_sequence_parallel and (length // self._cp) % tp:
            held = "" if self._cp == 1 else f" (each cp rank's share of {length // self._cp})"
            raise ValueError(
                f"a sequence of {length} tokens{held} does not split over tp_size={tp}: enable_sequence_parallel "
                f"splits the residual stream along the sequence into {tp} equal shares [CFG-9]; pad the rows on the "
                "right to a multiple of it"
            )

    def resolve(self, world_size: int) -> DistributedConfig:
        """This config bound to ``world_size`` ranks: fills a deferred tp_size and checks CFG-1."""
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"DistributedConfig.resolve: world_size must be a positive int, got {world_size!r}")
        if self.tp_size is None:
            others = self.dp_size * self._cp * self._pp
            names, values = self._size_terms(("dp_replicate_size", "fsdp_size", "cp_size", "pp_size"))
            if world_size % others:
                raise _rule_error(
                    "CFG-2",
                    f"tp_size=None is inferred as world_size // ({names}), but world_size={world_size} is not "
                    f"divisible by {values} = {others}",
                )
            return self.from_dict({**self.to_dict(), "tp_size": world_size // others})
        if world_size != self.world_size:
            names, values = self._size_terms(("dp_replicate_size", "fsdp_size", "cp_size", "tp_size", "pp_size"))
            raise _rule_error("CFG-1", f"world_size={world_size} must equal {names} = {values} = {self.world_size}")
        return self

    def _size_terms(self, fields: tuple[str, ...]) -> tuple[str, str]:
        """``("a * b", "2 * 4")``: the product of ``fields`` as names and values, cp_size only where it is set."""
        shown = [name for name in fields if name != "cp_size" or self._cp > 1]
        return " * ".join(shown), " * ".join(str(getattr(self, name)) for name in shown)

    def check_expert_mode(self, mode: ExpertMode) -> None:
        """Rules tying sizes to the EP mechanism a resolved ep_plan selects (CFG-4, CFG-5)."""
        if mode == "masking" and self.ep_size != self.tp_size:
            raise _rule_error(
                "CFG-4",
                f"masked EP plans (ep_router + moe_tp_experts) need ep_size == tp_size, got ep_size={self.ep_size}, "
                f"tp_size={self.tp_size}; use token dispatch ('ep_dispatch_experts') for ep_size > tp_size",
            )
        if mode == "dispatch" and self._pp > 1:
            raise _rule_error(
                "CFG-5", f"token dispatch ('ep_dispatch_experts') cannot be combined with pp_size={self.pp_size}"
            )

    # --- serialisation ----------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of the normalised fields; ``from_dict`` gives back an equal config."""
        return self.model_dump()

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DistributedConfig:
        if not isinstance(data, dict):
            raise ValueError(f"DistributedConfig.from_dict needs a dict, got {type(data).__name__}")
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> DistributedConfig:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"DistributedConfig.from_json: not valid JSON ({exc})") from None
        return cls.from_dict(data)

    def __repr__(self) -> str:
        sizes = ("dp_replicate_size", "fsdp_size", "cp_size", "tp_size", "ep_size", "pp_size")
        parts = [f"{name}={getattr(self, name)!r}" for name in sizes]
        defaults = type(self).model_fields
        parts += [f"{name}={value!r}" for name, value in self if name not in sizes and value != defaults[name].default]
        return f"DistributedConfig({', '.join(parts)})"

    __str__ = __repr__
