"""Counting the places where a rank's host waits for its device: the sync budget's meter (issue 36).

On CUDA every one of these blocks the host until the device catches up; on CPU nothing waits, but the
same calls are made, so counting the calls measures the budget on any machine::

    value out of a tensor     .item()  bool(t)  int(t)  float(t)      aten._local_scalar_dense
    whole tensor to the host  .tolist()  .cpu()  .numpy()
    a blocking copy           .to(device) / .cuda() without non_blocking=True (host -> device waits too: the
                              copy is queued behind the device's work, and a pageable source is copied in place)
    a shape from the data     nonzero, masked_select, unique, t[bool_mask], repeat_interleave(counts)

    with HostSyncs() as syncs:
        train_step(ctx, micro_batches, global_tokens)
    syncs.count        # 5
    syncs.sites        # Counter({"raymoe/parallel/styles/dispatch.py:88 tolist": 4, ...})

Reading a tensor the meter saw brought to the host (``host = t.cpu(); float(host[0])``) is free and not
counted; reading ``t`` again is not (on CPU, where ``.cpu()`` returns ``t`` itself, the meter hands back a copy,
as a GPU would). On CPU a ``.cpu()`` or ``.to(device)`` of a tensor that was never on a device counts too (the meter
cannot tell host from device there), so code on the hot path keeps host-side metadata as Python values, copies
with :func:`raymoe.models.common.transfer.to_device` (no call at all when the tensor is where it goes) and never
``.to()``-s a tensor to the device it is on. On a GPU,
``torch.cuda.set_sync_debug_mode("warn")`` reports the real syncs (``benchmarks/gpu_check.sh``).
"""

from __future__ import annotations

import traceback
from collections import Counter
from types import TracebackType
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# Tensor methods that copy a tensor to the host (the scalar reads reach aten._local_scalar_dense below).
_TO_HOST = {torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy}
_COPIES = {torch.Tensor.to, torch.Tensor.cuda}
# Operators whose output shape depends on the data: the host must read it from the device.
_DATA_SHAPED = {
    aten._local_scalar_dense.default,
    aten.nonzero.default,
    aten.masked_select.default,
    aten._unique2.default,
    aten.unique_dim.default,
    aten.unique_consecutive.default,
    aten.repeat_interleave.Tensor,
}


class HostSyncs:
    """A context counting device -> host syncs of the calling thread (autograd's backward included on CPU)."""

    def __init__(self) -> None:
        self.sites: Counter[str] = Counter()
        self._host: list[torch.Tensor] = []  # what was brought to the host (kept alive: their storages stay unique)
        self._host_storages: set[int] = set()
        self._modes = (_ToHost(self), _DataShaped(self))

    @property
    def count(self) -> int:
        return sum(self.sites.values())

    def __enter__(self) -> HostSyncs:
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(kind, error, trace)

    def record(self, what: str, tensor: Any) -> None:
        """A sync reading ``tensor`` (not counted when it lies in something already brought to the host)."""
        if not (isinstance(tensor, torch.Tensor) and _storage(tensor) in self._host_storages):
            self.sites[f"{_caller()} {what}"] += 1

    def on_host(self, result: torch.Tensor) -> None:
        """``result`` is a host copy: reading it later is free."""
        self._host.append(result)
        self._host_storages.add(_storage(result))


class _ToHost(TorchFunctionMode):
    def __init__(self, meter: HostSyncs) -> None:
        super().__init__()
        self.meter = meter

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        counted = func in _TO_HOST or (func in _COPIES and _blocking_copy(func, args, kwargs))
        if counted:
            self.meter.record(func.__name__, args[0])
        result = func(*args, **kwargs)
        if counted and isinstance(result, torch.Tensor) and result.device.type == "cpu":
            if _storage(result) == _storage(args[0]):  # on CPU, .cpu() is the tensor itself; on a GPU, a copy:
                result = result.clone()  # so it is one here too, or reading the original later would pass as free
            self.meter.on_host(result)
        return result


class _DataShaped(TorchDispatchMode):
    def __init__(self, meter: HostSyncs) -> None:
        super().__init__()
        self.meter = meter

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _DATA_SHAPED and not (func is aten.repeat_interleave.Tensor and "output_size" in kwargs):
            self.meter.record(func.__name__ if func is not aten._local_scalar_dense.default else "item", args[0])
        elif func is aten.index.Tensor and any(_is_mask(index) for index in args[1]):
            self.meter.record("boolean index", None)
        return func(*args, **kwargs)


def _blocking_copy(func: Any, args: Any, kwargs: Any) -> bool:
    """Whether ``Tensor.to(*args, **kwargs)`` (or ``.cuda``) copies to a device without ``non_blocking=True``.

    On CPU a ``.to(ctx.device)`` of a host tensor is counted: on CUDA it is a copy to the device."""
    if kwargs.get("non_blocking") or any(arg is True for arg in args[2:]):
        return False
    if func is torch.Tensor.cuda:
        return True
    targets = [kwargs.get("device"), *args[1:2]]
    return any(isinstance(target, str | torch.device) for target in targets)


def _storage(tensor: torch.Tensor) -> int:
    """The address of ``tensor``'s storage; 0 for one that holds none (FSDP2 frees by resizing storages to 0)."""
    try:
        return int(tensor.untyped_storage().data_ptr())
    except RuntimeError:
        return 0


def _is_mask(index: Any) -> bool:
    return isinstance(index, torch.Tensor) and index.dtype == torch.bool


def _caller() -> str:
    """``path:line`` of the innermost raymoe frame that led here (the call that synced), and of the innermost
    frame when that is in another package (``raymoe/rank/pipeline.py:136 [torch/.../stage.py:812]``)."""
    meter = ("host_syncs.py", "/torch/overrides.py", "/torch/utils/_python_dispatch.py")
    frames = [frame for frame in traceback.extract_stack(limit=60) if not frame.filename.endswith(meter)]
    ours = next((frame for frame in reversed(frames) if "/raymoe/" in frame.filename), None)
    site = f"raymoe/{ours.filename.rsplit('/raymoe/', 1)[1]}:{ours.lineno}" if ours else "outside raymoe"
    innermost = frames[-1] if frames else None
    if innermost is not None and innermost is not ours:
        tail = innermost.filename.rsplit("/site-packages/", 1)[-1]
        site += f" [{tail}:{innermost.lineno}]"
    return site
