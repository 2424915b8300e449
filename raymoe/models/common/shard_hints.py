"""Attributes a model sets on its modules so the parallel layer can check a plan against them.

Models know nothing of distribution; they describe their modules with plain attributes, and
the parallel styles (:mod:`raymoe.parallel.styles`) read them:

    tp_block_size       on a projection whose features come in indivisible blocks (attention:
                        head_dim), so a plan that would give a rank part of a head fails early
    num_experts         on a router or experts module: how many experts it scores or holds
    qk_rope_head_dim    on MLA's kv_a_proj_with_mqa: how many output features are the RoPE part
"""

SHARD_BLOCK_ATTR = "tp_block_size"
NUM_EXPERTS_ATTR = "num_experts"
ROPE_DIM_ATTR = "qk_rope_head_dim"
