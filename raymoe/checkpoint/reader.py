"""Reading hub safetensors checkpoints, whole parameters or any block of them.

A checkpoint directory holds ``model.safetensors``, or shards listed by
``model.safetensors.index.json``. :class:`SafetensorsFiles` maps hub tensor names to files and
opens each file once, on first use. :class:`CheckpointReader` puts a model's hub layout on top:
it answers in model parameter names and fused shapes, and reads a rectangular block of a fused
parameter (given per-dimension slices of the fused shape) by reading only the overlapping parts
of the hub tensors, through ``safe_open(...).get_slice``::

    gate_up_proj [E, 2I, H], block (experts 4..6, rows 0..I/2, all H)
        expert 4: gate_proj[0:I/2, :]        (the up half does not overlap: not read)
        expert 5: gate_proj[0:I/2, :]

A transposed part is read with the block's last two ranges swapped; an MXFP4 part reads only the
32-value blocks (and their scales) that the columns overlap, then dequantizes::

    down_proj [E, H, I] = Mxfp4(blocks [E, H, I/32, 16], scales [E, H, I/32]), block (.., .., 40..70)
        blocks[.., .., 1:3, :], scales[.., .., 1:3] -> 64 values (columns 32..96) -> columns 40..70

A block-scaled FP8 part reads the fp8 block and the scales of the (128 x 128) blocks it overlaps, and
multiplies in float32 (:mod:`raymoe.checkpoint.fp8`).

Tensor-parallel and expert-parallel loaders read each rank's shard this way; ``bytes_read``
counts the bytes taken from the files (uint8 bytes for MXFP4, one byte a value plus scales for FP8).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor

from raymoe.checkpoint.fp8 import DEQUANTIZED_DTYPE, FP8_DTYPE, SCALE_DTYPES, dequantize_fp8_block
from raymoe.checkpoint.mxfp4 import BLOCK_SIZE, BYTES_PER_BLOCK, dequantize_mxfp4
from raymoe.models.common.hub_layout import (
    Concat,
    Fp8Block,
    HubKeys,
    HubLayout,
    Mxfp4,
    Stack,
    Transpose,
    hub_key_names,
)

SAFETENSORS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# safetensors dtype names of the float dtypes raymoe loads; anything else (ints, fp8 with scales) is refused.
FLOAT_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
MXFP4_DTYPE = "BF16"  # what MXFP4 parameters dequantize to

Block = tuple[tuple[int, int], ...]  # per dimension [start, stop)


@dataclass(frozen=True)
class _TensorInfo:
    shape: tuple[int, ...]
    dtype: str  # safetensors name, e.g. "F32"


class SafetensorsFiles:
    """Hub tensor name -> its file in a checkpoint directory; files opened lazily, each once.

    ``bytes_read`` counts the bytes of every slice read so far (metadata not included).
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        self._stack = ExitStack()
        self._handles: dict[str, Any] = {}
        self._info: dict[str, _TensorInfo] = {}
        self.bytes_read = 0
        self.file_of = self._map_files()

    def _map_files(self) -> dict[str, str]:
        index_path = self.directory / INDEX_FILE
        if index_path.is_file():
            with index_path.open() as f:
                weight_map = json.load(f).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ValueError(f"{index_path} has no 'weight_map' object")
            absent = sorted({file for file in weight_map.values() if not (self.directory / file).is_file()})
            if absent:
                raise ValueError(f"{index_path} lists shard files that are not in {self.directory}: {absent}")
            return dict(weight_map)
        if (self.directory / SAFETENSORS_FILE).is_file():
            return dict.fromkeys(self._open(SAFETENSORS_FILE).keys(), SAFETENSORS_FILE)
        others = sorted(path.name for path in self.directory.glob("*.bin"))
        hint = f"; it has {', '.join(others[:3])}: raymoe reads safetensors checkpoints only" if others else ""
        raise ValueError(f"no {SAFETENSORS_FILE} or {INDEX_FILE} in {self.directory}{hint}")

    def _open(self, file: str) -> Any:
        if file not in self._handles:
            path = self.directory / file
            try:
                handle = safe_open(path, framework="pt")
            except (SafetensorError, OSError) as exc:
                size = path.stat().st_size if path.is_file() else None
                raise ValueError(
                    f"{path} ({size} bytes) is not a readable safetensors file: {exc}; is it truncated (an "
                    "interrupted download or copy)?"
                ) from exc
            self._handles[file] = self._stack.enter_context(handle)
        return self._handles[file]

    def keys(self) -> list[str]:
        return list(self.file_of)

    def __contains__(self, key: object) -> bool:
        return key in self.file_of

    def info(self, key: str) -> _TensorInfo:
        if key not in self._info:
            view = self._open(self.file_of[key]).get_slice(key)
            self._info[key] = _TensorInfo(tuple(view.get_shape()), view.get_dtype())
        return self._info[key]

    def read(self, key: str, block: Block) -> Tensor:
        """The ``block`` of hub tensor ``key``; only those bytes are read from the file."""
        view = self._open(self.file_of[key]).get_slice(key)
        tensor: Tensor = view[tuple(slice(start, stop) for start, stop in block)]
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor

    def close(self) -> None:
        self._stack.close()
        self._handles.clear()


class _LayoutMismatch(ValueError):
    """The parts of a fused parameter do not fit together, or are stored wrongly (reported by ``check``)."""


@dataclass
class _Problems:
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    wrong_shape: list[str] = field(default_factory=list)
    wrong_dtype: list[str] = field(default_factory=list)

    def message(self, where: str, model_name: str, shown: int = 20) -> str | None:
        sections = [
            ("missing", self.missing),
            ("unexpected", self.unexpected),
            ("wrong shape", self.wrong_shape),
            ("wrong dtype", self.wrong_dtype),
        ]
        lines = []
        for title, items in sections:
            if items:
                more = f", ... (+{len(items) - shown} more)" if len(items) > shown else ""
                lines.append(f"  {title} ({len(items)}): " + ", ".join(items[:shown]) + more)
        if not lines:
            return None
        return f"checkpoint {where} does not match {model_name}:\n" + "\n".join(lines)


class CheckpointReader:
    """A checkpoint seen through a model's :data:`HubLayout`: parameters by model name, fused shapes.

    ``ignored`` says which hub tensors may be present without being loaded (e.g. a tied head);
    ``files``, already open on ``directory``, is used instead of opening it again.
    Use as a context manager, or call :meth:`close`.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        layout: HubLayout,
        ignored: Callable[[str], bool] = lambda key: False,
        *,
        files: SafetensorsFiles | None = None,
    ) -> None:
        self.files = files if files is not None else SafetensorsFiles(directory)
        self.layout = layout
        self.ignored = ignored

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        self.files.close()

    @property
    def bytes_read(self) -> int:
        """Bytes read from the checkpoint files so far, by every read of this reader (cumulative)."""
        return self.files.bytes_read

    # --- metadata ------------------------------------------------------------------------------

    def shape(self, name: str) -> torch.Size:
        """Shape of model parameter ``name`` as assembled from the checkpoint."""
        return torch.Size(self._shape(self._keys(name)))

    def dtype(self, name: str) -> torch.dtype:
        """The checkpoint dtype of parameter ``name`` (all its parts share it)."""
        dtype = self._dtype_name(self._keys(name))
        if dtype not in FLOAT_DTYPES:
            raise ValueError(f"parameter {name!r} is stored as {dtype}; raymoe loads {', '.join(FLOAT_DTYPES)}")
        return FLOAT_DTYPES[dtype]

    def check(self, expected_shapes: Mapping[str, Sequence[int]], model_name: str = "the model") -> None:
        """One ``ValueError`` listing every missing, unexpected, wrong-shape and wrong-dtype tensor.

        ``expected_shapes`` maps each model parameter to load to its (fused) shape.
        """
        problems = _Problems()
        used: set[str] = set()
        for name, want in expected_shapes.items():
            if name not in self.layout:
                raise ValueError(f"parameter {name!r} has no entry in the hub layout of {model_name}")
            keys = self.layout[name]
            parts = list(hub_key_names(keys))
            used.update(parts)
            absent = [part for part in parts if part not in self.files]
            problems.missing.extend(absent)
            if not absent:
                self._check_parameter(name, keys, tuple(want), problems)
        problems.unexpected = sorted(key for key in self.files.file_of if key not in used and not self.ignored(key))
        message = problems.message(str(self.files.directory), model_name)
        if message is not None:
            raise ValueError(message)

    def _check_parameter(self, name: str, keys: HubKeys, want: tuple[int, ...], problems: _Problems) -> None:
        try:
            have = self._shape(keys)
        except _LayoutMismatch as exc:
            problems.wrong_shape.append(f"{name}: {exc}")
            return
        if have != want:
            problems.wrong_shape.append(f"{name}: checkpoint {have}, model {want}")
        try:
            dtype = self._dtype_name(keys)
        except _LayoutMismatch as exc:
            problems.wrong_dtype.append(f"{name}: {exc}")
            return
        if dtype not in FLOAT_DTYPES:
            problems.wrong_dtype.append(f"{name}: {dtype} (raymoe loads {', '.join(FLOAT_DTYPES)})")

    def _keys(self, name: str) -> HubKeys:
        if name not in self.layout:
            raise ValueError(f"{name!r} is not a parameter of this checkpoint's hub layout")
        return self.layout[name]

    def _shape(self, keys: HubKeys) -> tuple[int, ...]:
        if isinstance(keys, str):
            return self.files.info(keys).shape
        if isinstance(keys, Transpose):
            shape = self._shape(keys.part)
            if len(shape) < 2:
                raise _LayoutMismatch(f"transposed part {next(hub_key_names(keys))} is {shape}, needs 2 dims or more")
            return (*shape[:-2], shape[-1], shape[-2])
        if isinstance(keys, Mxfp4):
            return self._mxfp4_shape(keys)
        if isinstance(keys, Fp8Block):
            return self._fp8_shape(keys)
        shapes = [self._shape(part) for part in keys.parts]
        if isinstance(keys, Stack):
            if any(shape != shapes[0] for shape in shapes):
                raise _LayoutMismatch(f"stacked parts differ in shape: {_describe_parts(keys, shapes)}")
            return (len(shapes), *shapes[0])
        dim = keys.dim
        others = {shape[:dim] + shape[dim + 1 :] for shape in shapes}
        if len(others) > 1 or len({shape[dim] for shape in shapes}) > 1:
            raise _LayoutMismatch(f"concatenated parts differ in shape: {_describe_parts(keys, shapes)}")
        first = shapes[0]
        return (*first[:dim], sum(shape[dim] for shape in shapes), *first[dim + 1 :])

    def _mxfp4_shape(self, keys: Mxfp4) -> tuple[int, ...]:
        """``blocks [..., R, G, 16]`` and ``scales [..., R, G]`` -> ``[..., R, G*32]``."""
        blocks, scales = self.files.info(keys.blocks).shape, self.files.info(keys.scales).shape
        if len(blocks) < 3 or blocks[-1] != BYTES_PER_BLOCK:
            raise _LayoutMismatch(f"MXFP4 blocks {keys.blocks} are {blocks}, expected [..., R, G, {BYTES_PER_BLOCK}]")
        if blocks[:-1] != scales:
            raise _LayoutMismatch(
                f"MXFP4 scales {keys.scales} are {scales}, expected {blocks[:-1]} (the shape of blocks {keys.blocks} "
                "without its last dim)"
            )
        return (*scales[:-1], scales[-1] * BLOCK_SIZE)

    def _fp8_shape(self, keys: Fp8Block) -> tuple[int, ...]:
        """``weight [R, C]`` with ``scale_inv [ceil(R / br), ceil(C / bc)]``."""
        weight, scales = self.files.info(keys.weight).shape, self.files.info(keys.scale_inv).shape
        if len(weight) != 2:
            raise _LayoutMismatch(f"FP8 weight {keys.weight} is {weight}, expected 2 dims")
        want = tuple(-(-size // block) for size, block in zip(weight, keys.block, strict=True))
        if scales != want:
            raise _LayoutMismatch(
                f"FP8 scales {keys.scale_inv} are {scales}, expected {want} (one per {keys.block} block of "
                f"{keys.weight} {weight})"
            )
        return weight

    def _dtype_name(self, keys: HubKeys) -> str:
        """The safetensors dtype name of the parameter ``keys`` assembles (``BF16`` for MXFP4)."""
        if isinstance(keys, str):
            return self.files.info(keys).dtype
        if isinstance(keys, Transpose):
            return self._dtype_name(keys.part)
        if isinstance(keys, Mxfp4):
            for key in (keys.blocks, keys.scales):
                if self.files.info(key).dtype != "U8":
                    raise _LayoutMismatch(f"MXFP4 tensor {key} is stored as {self.files.info(key).dtype}, expected U8")
            return MXFP4_DTYPE
        if isinstance(keys, Fp8Block):
            weight, scale = self.files.info(keys.weight).dtype, self.files.info(keys.scale_inv).dtype
            if weight != FP8_DTYPE or scale not in SCALE_DTYPES:
                raise _LayoutMismatch(
                    f"FP8 tensors {keys.weight} / {keys.scale_inv} are stored as {weight} / {scale}, expected "
                    f"{FP8_DTYPE} / one of {', '.join(SCALE_DTYPES)}"
                )
            return DEQUANTIZED_DTYPE
        dtypes = {self._dtype_name(part) for part in keys.parts}
        if len(dtypes) > 1:
            raise _LayoutMismatch(f"parts stored in different dtypes {sorted(dtypes)}")
        return dtypes.pop()

    # --- reading -------------------------------------------------------------------------------

    def read(self, name: str, index: Sequence[slice] | None = None) -> Tensor:
        """Parameter ``name``, or the block ``index`` of it (one slice per leading dimension, step 1).

        Returned in the checkpoint dtype, on CPU. Only bytes inside the block are read.
        """
        keys = self._keys(name)
        block = _normalise_index(index, self._shape(keys), name)
        out = torch.empty([stop - start for start, stop in block], dtype=self.dtype(name))
        self._fill(keys, block, out)
        return out

    def read_packed(self, name: str, role: str, index: Sequence[slice]) -> Tensor:
        """The ``block`` of MXFP4 parameter ``name``'s hub ``role`` tensor ("blocks" ``[..., R, G, 16]`` or "scales"
        ``[..., R, G]``), its uint8 bytes as stored (experts kept packed: :mod:`raymoe.models.moe.packed`)."""
        keys = self._keys(name)
        if not isinstance(keys, Mxfp4):
            raise ValueError(f"{name} is not stored in MXFP4 in {self.files.directory}: it cannot be kept packed")
        key = keys.blocks if role == "blocks" else keys.scales
        return self.files.read(key, _normalise_index(index, self.files.info(key).shape, key))

    def _fill(self, keys: HubKeys, block: Block, out: Tensor) -> None:
        if out.numel() == 0:
            return
        if isinstance(keys, str):
            out.copy_(self.files.read(keys, block))
        elif isinstance(keys, Transpose):  # the part's block, swapped, written through a transposed view
            self._fill(keys.part, (*block[:-2], block[-1], block[-2]), out.transpose(-2, -1))
        elif isinstance(keys, Mxfp4):
            self._fill_mxfp4(keys, block, out)
        elif isinstance(keys, Fp8Block):
            self._fill_fp8(keys, block, out)
        elif isinstance(keys, Stack):
            (start, stop), inner = block[0], block[1:]
            for row, part in enumerate(keys.parts[start:stop]):
                self._fill(part, inner, out[row])
        else:
            self._fill_concat(keys, block, out)

    def _fill_concat(self, keys: Concat, block: Block, out: Tensor) -> None:
        """Each part covers ``[offset, offset + size)`` of the concatenated dim; read its overlap with the block."""
        dim = keys.dim
        start, stop = block[dim]
        offset = 0
        for part in keys.parts:
            size = self._shape(part)[dim]
            lo, hi = max(start, offset), min(stop, offset + size)
            if lo < hi:
                part_block = (*block[:dim], (lo - offset, hi - offset), *block[dim + 1 :])
                self._fill(part, part_block, out.narrow(dim, lo - start, hi - lo))
            offset += size

    def _fill_mxfp4(self, keys: Mxfp4, block: Block, out: Tensor) -> None:
        """Read the 32-value groups that columns ``[c0, c1)`` overlap (and their scales), dequantize, narrow."""
        c0, c1 = block[-1]
        groups = (c0 // BLOCK_SIZE, -(-c1 // BLOCK_SIZE))
        blocks = self.files.read(keys.blocks, (*block[:-1], groups, (0, BYTES_PER_BLOCK)))
        scales = self.files.read(keys.scales, (*block[:-1], groups))
        values = dequantize_mxfp4(blocks, scales, dtype=out.dtype)
        out.copy_(values.narrow(-1, c0 - groups[0] * BLOCK_SIZE, c1 - c0))

    def _fill_fp8(self, keys: Fp8Block, block: Block, out: Tensor) -> None:
        """Read the fp8 block and the scales of the (br x bc) blocks it overlaps; multiply in float32."""
        (r0, r1), (c0, c1) = block
        (br, bc) = keys.block
        weight = self.files.read(keys.weight, block)
        scales = self.files.read(keys.scale_inv, ((r0 // br, -(-r1 // br)), (c0 // bc, -(-c1 // bc))))
        out.copy_(dequantize_fp8_block(weight, scales, keys.block, (r0, c0)))


def _normalise_index(index: Sequence[slice] | None, shape: tuple[int, ...], name: str) -> Block:
    slices = list(index or ())
    if len(slices) > len(shape):
        raise ValueError(f"index of {name!r} has {len(slices)} slices but the parameter has {len(shape)} dims {shape}")
    slices += [slice(None)] * (len(shape) - len(slices))
    block = []
    for dim, (s, size) in enumerate(zip(slices, shape, strict=True)):
        if not isinstance(s, slice) or s.step not in (None, 1):
            raise ValueError(f"index of {name!r}, dim {dim}: expected a slice with step 1, got {s!r}")
        start, stop, _ = s.indices(size)
        block.append((start, max(start, stop)))
    return tuple(block)


def _describe_parts(keys: Stack | Concat, shapes: list[tuple[int, ...]]) -> str:
    first = shapes[0]
    odd = [(part, shape) for part, shape in zip(keys.parts, shapes, strict=True) if shape != first]
    shown = ", ".join(f"{next(hub_key_names(part))} {shape}" for part, shape in odd[:3])
    return f"{next(hub_key_names(keys.parts[0]))} is {first} but {shown}"
