"""LoRA factors on a rank: filled at load (from a PEFT adapter directory, or freshly initialised), gathered whole
for saving (merged into their base weights for a hub checkpoint by
:func:`~raymoe.models.common.lora.merge_stream`).

Fresh factors are drawn whole, in PEFT's layout, from a generator seeded by the spec's seed and the factor's path,
then cut to this rank's slice, so every layout starts from the same adapter values (and a test can compare them
with one process). ``init_lora_weights=True``: A Kaiming-uniform (``a = sqrt(5)``, ``nn.Linear``'s default), B
zero; ``False``: both Kaiming-uniform, as PEFT leaves them.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Iterator

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from raymoe.checkpoint.adapter import AdapterFile, from_peft, peft_keys, to_peft
from raymoe.models.common.lora import AdapterTarget, adapter_parameters
from raymoe.parallel.sharding import Block, local_tensor, read_local_shard
from raymoe.rank.context import RankContext
from raymoe.rank.contract import AdapterTensors
from raymoe.spec.lora import LoraSpec
from raymoe.spec.topology import Axis


def fill_adapters(model: nn.Module, spec: LoraSpec) -> None:
    """Give every factor of ``model`` (local storage allocated, e.g. after ``to_empty``) its values for this rank."""
    keys = peft_keys(spec.targets)
    source = AdapterFile(spec.adapter_dir, spec.targets) if spec.adapter_dir is not None else None
    for name, param in adapter_parameters(model):
        target, _ = keys[name]
        shape = tuple(param.shape)
        full = source.read(name, shape) if source is not None else fresh_factor(target, name, shape, spec)
        local = local_tensor(param)
        with torch.no_grad():
            local.copy_(read_local_shard(param, _slicer(full)))


def _slicer(full: Tensor) -> Callable[[Block], Tensor]:
    def read(block: Block) -> Tensor:
        return full[block]

    return read


def fresh_factor(target: AdapterTarget, name: str, shape: tuple[int, ...], spec: LoraSpec) -> Tensor:
    """The initial value of factor ``name`` (global ``shape``), the same on every rank and layout."""
    is_a = name.endswith("lora_A")
    peft_shape = to_peft(target, name, torch.empty(shape, device="meta")).shape
    if not is_a and spec.config.init_lora_weights:
        return torch.zeros(shape)
    generator = torch.Generator().manual_seed(spec.seed * 1_000_003 + zlib.crc32(name.encode()))
    values = torch.empty(peft_shape)
    nn.init.kaiming_uniform_(values, a=math.sqrt(5), generator=generator)
    return from_peft(target, name, values, shape)


def full_adapters(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """``(path, full factor on the CPU)`` for every factor; a collective for each sharded one (every rank calls)."""
    for name, param in adapter_parameters(model):
        full = param.full_tensor() if isinstance(param, DTensor) else param
        yield name, full.detach().to("cpu", copy=True)


def gather_adapters(ctx: RankContext) -> AdapterTensors:
    """Every rank gathers the factors of the parts it holds; the first rank of each pipeline stage answers them."""
    loaded = ctx.require_model()
    if loaded.spec.lora is None:
        raise ValueError("this model has no LoRA adapters (load it with from_pretrained(..., lora=...))")
    tensors = {name: tensor for part in loaded.parts for name, tensor in full_adapters(part)}
    coords = ctx.coords
    first_of_stage = not any(coords.on(axis) for axis in (Axis.DP_REPLICATE, Axis.FSDP, Axis.TP, Axis.EP, Axis.EFSDP))
    return AdapterTensors(tensors if first_of_stage else {})
