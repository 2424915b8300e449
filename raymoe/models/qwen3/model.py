"""The Qwen3 causal LM: the shared dense decoder with q/k norms (their TP rules come with them)."""

from __future__ import annotations

from raymoe.models.common.dense import DenseCausalLM


class Qwen3ForCausalLM(DenseCausalLM):
    """Hub names as they are; ``config.qk_norm`` is always true for this family."""

    model_type = "qwen3"
