"""What a handle loaded, as properties (``DistributedModel`` inherits them): topology, source, plans, LoRA config,
precision policy, and the rank picture ``describe`` prints (``picture``). Read from the launch spec and the ranks'
load reports; nothing here reaches a rank."""

from __future__ import annotations

from raymoe.driver.adapters import describe_adapters
from raymoe.models.common.config import ModelConfig
from raymoe.rank.contract import LoadReport
from raymoe.spec.launch import LaunchSpec
from raymoe.spec.lora import LoraConfig
from raymoe.spec.plans import ResolvedPlans
from raymoe.spec.precision import PrecisionPolicy
from raymoe.spec.reshard import describe_reshard
from raymoe.spec.topology import Topology


class LoadedView:
    """Mixed into :class:`~raymoe.driver.handle.DistributedModel`: its ``_spec`` and ``load_reports``."""

    _spec: LaunchSpec
    load_reports: list[LoadReport]
    model_config: ModelConfig

    @property
    def topology(self) -> Topology:
        return self._spec.topology

    @property
    def source(self) -> str:
        """The checkpoint directory (absolute) or hub id this model was loaded from."""
        return self._spec.source

    @property
    def tp_plan(self) -> dict[str, str]:
        """The merged TP plan (model defaults + overrides), wildcard keys (PLAN-1)."""
        return dict(self._spec.plans.tp_plan)

    @property
    def ep_plan(self) -> dict[str, str]:
        return dict(self._spec.plans.ep_plan)

    @property
    def fsdp_plan(self) -> dict[str, str]:
        return dict(self._spec.plans.fsdp_plan)

    @property
    def plans(self) -> ResolvedPlans:
        """The resolved plans every rank applied: merged plans, concrete rules and the style instances."""
        return self._spec.plans

    @property
    def supports_tp_plan(self) -> bool:
        return bool(self._spec.plans.tp_plan)

    @property
    def lora(self) -> LoraConfig | None:
        """The LoRA adapters' config (a PEFT directory's when loaded from one), or None: every weight trains."""
        return self._spec.lora.config if self._spec.lora is not None else None

    @property
    def precision(self) -> PrecisionPolicy:
        """The precision policy the ranks hold the model in (:mod:`raymoe.spec.precision`)."""
        return self.load_reports[0].precision

    def picture(self) -> str:
        """The rank picture of this layout (SPEC TOPO-3) and the precision policy (``describe`` adds what the ranks
        hold, measured)."""
        num_experts = self.model_config.moe.num_experts if self.model_config.moe is not None else None
        text = f"{self.topology.describe(num_experts=num_experts)}\n{self.precision.describe()}"
        keeps = self.load_reports[0].keeps_gathered
        if keeps is not None:
            text += "\n" + describe_reshard(self.topology.config.fsdp_reshard_after_forward, keeps)
        if self._spec.lora is None:
            return text
        largest = max(self.load_reports, key=lambda report: report.bytes_held)
        frozen_bytes = largest.bytes_held - largest.trainable_bytes
        lines = describe_adapters(
            self._spec, largest.trainable_params, largest.frozen_params, largest.trainable_bytes, frozen_bytes
        )
        return f"{text}\n{lines}"
