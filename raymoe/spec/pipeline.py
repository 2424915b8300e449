"""Pipeline stages: which decoder layers each stage runs and which pipeline rank holds it (SPEC §2, CFG-5, CFG-10).

Decided on the driver from the config and the meta model, before any actor starts. The model is cut
into ``pp_size * pp_stages_per_rank`` stages of consecutive decoder layers; the first stage also holds
the embedding, the last the final norm and the head (and computes the loss)::

    8 layers, pp_size=2, pp_schedule='1f1b'                     stage 0: embed, layers 0-3   on pp rank 0
                                                                stage 1: layers 4-7, norm, head   pp rank 1

    8 layers, pp_size=2, pp_schedule='interleaved_1f1b' (2 stages per rank)
        stage    0          1          2          3
        layers   0-1        2-3        4-5        6-7
        pp rank  0          1          0          1             stage s runs on pp rank s % pp_size

Without ``pp_split`` the layers are balanced by parameter count: the split that makes the heaviest stage
lightest and the stages most even, giving any spare layer to the earlier stages (the last one also runs
the head and the loss).
"""

from __future__ import annotations

from dataclasses import dataclass

from raymoe.models.common.decoder import CausalLM
from raymoe.spec.config import DistributedConfig


@dataclass(frozen=True)
class StagePlan:
    """The stages of one pipeline: ``starts[s]`` is the first decoder layer of stage ``s``."""

    num_layers: int
    starts: tuple[int, ...]
    pp_size: int
    schedule: str
    microbatches: int

    @property
    def num_stages(self) -> int:
        return len(self.starts)

    def layers(self, stage: int) -> range:
        """Decoder layers of ``stage``."""
        end = self.starts[stage + 1] if stage + 1 < self.num_stages else self.num_layers
        return range(self.starts[stage], end)

    def stages_of(self, pp_coord: int) -> tuple[int, ...]:
        """Stages held by pipeline rank ``pp_coord``, in order: ``pp_coord``, ``pp_coord + pp_size``, ..."""
        return tuple(range(pp_coord, self.num_stages, self.pp_size))

    def rank_of(self, stage: int) -> int:
        """The pipeline rank (pp coordinate) that runs ``stage``."""
        return stage % self.pp_size

    def is_first(self, stage: int) -> bool:
        return stage == 0

    def is_last(self, stage: int) -> bool:
        return stage == self.num_stages - 1

    def describe(self) -> str:
        """``stage 0: layers 0-2 (pp rank 0); stage 1: layers 3-4 (pp rank 1)``."""
        parts = []
        for stage in range(self.num_stages):
            span = self.layers(stage)
            layers = f"layer {span[0]}" if len(span) == 1 else f"layers {span[0]}-{span[-1]}"
            parts.append(f"stage {stage}: {layers} (pp rank {self.rank_of(stage)})")
        return "; ".join(parts)


def plan_stages(model: CausalLM, config: DistributedConfig) -> StagePlan | None:
    """The stage plan of ``model`` under ``config`` (None when ``pp_size == 1``); ``ValueError`` naming the fields
    when the model cannot be cut that way."""
    pp = config.pp_size or 1
    if pp == 1:
        return None
    num_layers, stages = model.config.num_hidden_layers, config.num_stages
    if stages > num_layers:
        raise ValueError(
            f"DistributedConfig: pp_size={pp} * pp_stages_per_rank={config.stages_per_rank} = {stages} pipeline "
            f"stages, but the model has num_hidden_layers={num_layers}: every stage needs at least one decoder "
            "layer [CFG-10]"
        )
    if model.config.tie_word_embeddings:
        raise ValueError(
            f"DistributedConfig: pp_size={pp} with tie_word_embeddings=True is not supported yet: the embedding "
            "(first stage) and the head (last stage) would share one weight across pipeline ranks [CFG-10]"
        )
    if config.pp_split is not None:
        if config.pp_split[-1] >= num_layers:
            raise ValueError(
                f"DistributedConfig: pp_split={config.pp_split} starts a stage at layer {config.pp_split[-1]}, but "
                f"the model has num_hidden_layers={num_layers} (layers 0-{num_layers - 1}) [CFG-10]"
            )
        starts = (0, *config.pp_split)
    else:
        starts = balanced_starts([_layer_size(model, i) for i in range(num_layers)], stages)
    assert config.pp_microbatches is not None  # defaulted with pp_size > 1
    return StagePlan(num_layers, starts, pp, config.pp_schedule, config.pp_microbatches)


def balanced_starts(costs: list[int], stages: int) -> tuple[int, ...]:
    """First layer of each of ``stages`` contiguous, non-empty groups of ``costs``: the heaviest group as light as
    possible, then the groups as even as possible (least sum of squares); ties give the later stages less."""
    n = len(costs)
    prefix = [0]
    for layer_cost in costs:
        prefix.append(prefix[-1] + layer_cost)

    def cost(j: int, i: int) -> int:
        return prefix[i] - prefix[j]

    inf = float("inf")
    # heaviest[s][i]: the lightest heaviest group when the first i layers form s stages
    heaviest = [[inf] * (n + 1) for _ in range(stages + 1)]
    heaviest[0][0] = 0
    for s in range(1, stages + 1):
        for i in range(s, n + 1):
            heaviest[s][i] = min(max(heaviest[s - 1][j], cost(j, i)) for j in range(s - 1, i))
    target = heaviest[stages][n]
    # squares[s][i]: the least sum of squared group costs, no group above the target
    squares = [[inf] * (n + 1) for _ in range(stages + 1)]
    squares[0][0] = 0
    for s in range(1, stages + 1):
        for i in range(s, n + 1):
            options = [squares[s - 1][j] + cost(j, i) ** 2 for j in range(s - 1, i) if cost(j, i) <= target]
            squares[s][i] = min(options, default=inf)
    starts, end = [], n
    for s in range(stages, 0, -1):  # from the last stage: the latest start that keeps the optimum
        best = squares[s][end]
        start = max(
            j for j in range(s - 1, end) if cost(j, end) <= target and squares[s - 1][j] + cost(j, end) ** 2 == best
        )
        starts.append(start)
        end = start
    return tuple(reversed(starts))


def _layer_size(model: CausalLM, index: int) -> int:
    return sum(param.numel() for param in model.model.layers[index].parameters())
