"""Attributes a model sets on its modules so the parallel layer can check a plan against them.

Models know nothing of distribution; they describe their modules with plain attributes, and
the parallel styles (:mod:`raymoe.parallel.styles`) read them:

    tp_block_size       on a projection whose features come in indivisible blocks (attention:
                        head_dim), so a plan that would give a rank part of a head fails early;
                        an int for every parameter of the module, or {parameter name: int}
                        (gpt-oss experts: interleaved (gate, up) pairs in gate_up_proj only)
    num_experts         on a router or experts module: how many experts it scores or holds
    qk_rope_head_dim    on MLA's kv_a_proj_with_mqa: how many output features are the RoPE part
    expert_batched      on an experts module: every parameter leads with the expert dim
                        (weights [E, out, in], biases [E, out])
    output_bias         on an experts module: the name of the bias added once to each routed
                        pair's output ([E, H]); a style whose ranks each add a partial sum of the
                        output adds 1/size of it on each rank when it is not split
    lora_factors        on a module with LoRA adapters: {factor name: (base parameter name, "A" | "B")};
                        A [.., r, in] shares every dim of its base but the output features, B [.., out, r]
                        every dim but the input features (raymoe.models.common.lora)
    float32_parameters  on a module: names of its parameters held and used in float32 whatever the
                        model's dtype (a router's selection bias, as transformers keeps it)
    input_consumers     on a module: the names of its children that are the only users of its forward's first
                        argument (attention: q/k/v projections; a SwiGLU: gate and up), so tensor parallelism may
                        all-reduce that input's gradient once for all of them (raymoe.parallel.input_boundary)
"""

from __future__ import annotations

from torch import nn

SHARD_BLOCK_ATTR = "tp_block_size"
NUM_EXPERTS_ATTR = "num_experts"
ROPE_DIM_ATTR = "qk_rope_head_dim"
EXPERT_BATCHED_ATTR = "expert_batched"
OUTPUT_BIAS_ATTR = "output_bias"
FLOAT32_ATTR = "float32_parameters"
INPUT_CONSUMERS_ATTR = "input_consumers"
LORA_FACTORS_ATTR = "lora_factors"
LORA_FROZEN_ATTR = "lora_frozen"  # the direct parameters LoRA froze (trainable in full fine-tuning)
MXFP4_PACKED_ATTR = "mxfp4_packed"  # expert weights held as MXFP4 blocks + scales (raymoe.models.moe.packed)


def float32_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The modules of ``model`` (by path) that keep some parameters in float32."""
    return {path: module for path, module in model.named_modules() if getattr(module, FLOAT32_ATTR, ())}
