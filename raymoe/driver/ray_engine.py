"""What the driver decides for ``load_dataset(engine="ray")`` and ``from_ray_dataset``, before and after Ray Data
runs (the pipeline is ``actors/ray_data.py``, composed by ``raymoe/api.py``)::

    check_engine(engine)            "driver" or "ray", else one ValueError before any work
    read_format(path)               jsonl | parquet | datasets | text (by suffix; a local directory or hub id:
                                    a datasets split, loaded here and handed to Ray Data); .npy: a ValueError
    RayJob.of(first record, ...)    the record kind, the tokenize, pack and block operators, the window
    RayJob.streamed(blocks, stats)  the blocks' references and statistics -> StreamedData (+ report)

The Ray engine tokenizes and packs on the cluster's CPUs and leaves the rows there: the driver keeps references and
a few numbers a row (:mod:`raymoe.driver.streamed_data`). It has no tokenization cache, and ``num_proc`` is the
driver engine's: both are ValueErrors here, never ignored.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from raymoe.checkpoint.storage import url_scheme
from raymoe.driver.chat import ChatTemplate
from raymoe.driver.data_operators import RAY_PACK_WINDOW, BlockOperator, Decoding, PackOperator, TokenizeOperator
from raymoe.driver.dataset import encoding_of
from raymoe.driver.example_encoder import ExampleEncoder, LossOn
from raymoe.driver.local_paths import local_path, storage_path
from raymoe.driver.packing import DataReport, Overlong, Packing, check_seq_len
from raymoe.driver.records import Fields, record_kind
from raymoe.driver.row_packing import check_pack_options, check_pack_window
from raymoe.driver.streamed_data import BlockStats, Fetch, StreamedData
from raymoe.driver.tokenizer import TextTokenizer

ENGINES = ("driver", "ray")
DECODING: dict[str, Decoding] = {"jsonl": "json_lines", "text": "text_file", "parquet": "table", "datasets": "table"}


def check_engine(engine: object) -> str:
    if engine not in ENGINES:
        raise ValueError(f"load_dataset: engine={engine!r}: choose 'driver' (the default) or 'ray'")
    return str(engine)


def ray_source(path: str | os.PathLike[str]) -> str:
    """``path`` as Ray Data's read tasks get it, wherever they run: a storage URL checked here (known protocol, its
    package installed, reachable: one clear error on the driver), a local file or directory made absolute
    (``file://`` URLs are their path; a relative path would be read against each worker's own directory); a
    name that is no local path (a hub id) stays as it is."""
    text = os.fspath(path)
    if url_scheme(text) not in (None, "file"):
        return str(storage_path(text, "load_dataset path", write=False))
    local = local_path(text, "load_dataset path").expanduser()
    return str(local) if local.exists() else text


def read_format(path: str | os.PathLike[str]) -> str:
    """How Ray Data reads ``path`` (a local path or a URL, by its suffix)."""
    name = str(path)
    suffix = Path(name.split("?")[0]).suffix
    if suffix == ".npy":
        raise ValueError(
            f"load_dataset(engine='ray'): {name} is pre-tokenized (.npy); it needs no tokenizing or packing on the "
            "cluster: use engine='driver'"
        )
    if suffix in (".jsonl", ".parquet"):
        return suffix[1:]
    local = Path(name).expanduser()
    if "://" not in name and (local.is_dir() or not local.exists()):
        return "datasets"
    return "text"


@dataclass(frozen=True)
class RayJob:
    """The operators and options of one Ray Data run."""

    tokenize: TokenizeOperator
    pack: PackOperator
    pack_window: int
    source: str
    kind: str
    packing: Packing
    seq_len: int
    started: float

    @classmethod
    def of(
        cls,
        first: Any,
        decoding: Decoding,
        source: str,
        seq_len: int,
        tokenizer: TextTokenizer,
        *,
        text_field: str = "text",
        messages_field: str = "messages",
        prompt_field: str = "prompt",
        completion_field: str = "completion",
        packing: Packing = "document",
        loss_on: LossOn = "assistant",
        overlong: Overlong = "error",
        chat_template: ChatTemplate | str | os.PathLike[str] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
        pack_window: int | None = RAY_PACK_WINDOW,
    ) -> RayJob:
        """``first``: the dataset's first record (a one-row pyarrow table, None if empty) decides the kind."""
        check_seq_len(seq_len)
        check_pack_options(packing, overlong)
        window = check_pack_window(pack_window)
        if window is None:
            raise ValueError("engine='ray' packs bounded windows: pack_window must be an int >= 1 (default 10000)")
        records = [] if first is None else TokenizeOperator.records(first, decoding)
        if not records:
            raise ValueError(f"{source} is empty: it holds no records to train on")
        fields = Fields(text=text_field, messages=messages_field, prompt=prompt_field, completion=completion_field)
        kind = record_kind(records[0], fields)
        if kind is None:
            raise ValueError(f"{source} batch record 1 is neither a document ({text_field!r}) nor a conversation")
        template, options = encoding_of(tokenizer, fields, loss_on, chat_template, template_kwargs)
        encoder = ExampleEncoder(
            tokenizer.tokenizer, tokenizer.eos_token_id, template, kind, options, source, "batch record"
        )
        pack = PackOperator(kind, source, seq_len, packing, overlong)
        return cls(
            TokenizeOperator(encoder, decoding), pack, window, source, kind, packing, seq_len, time.perf_counter()
        )

    @property
    def to_block(self) -> BlockOperator:
        return BlockOperator(self.seq_len)

    def streamed(self, blocks: list[Any], stats: list[BlockStats], fetch: Fetch) -> StreamedData:
        """The pipeline's blocks as :class:`StreamedData`; every window but the last must hold ``pack_window``
        examples (a ``RuntimeError`` if Ray Data cut them otherwise: the rows would differ from the driver's)."""
        sizes = [size for s in stats for size in s.window_sizes]
        if any(size != self.pack_window for size in sizes[:-1]):
            raise RuntimeError(
                f"Ray Data gave packing windows of {sorted(set(sizes[:-1]))} examples, not {self.pack_window}"
            )
        tokens = sum(s.tokens for s in stats)
        examples = sum(s.examples for s in stats)
        if examples == 0 or tokens < 2:
            raise ValueError(
                f"{self.source} is empty: after dropping what exceeds seq_len={self.seq_len}, nothing is left"
            )
        report = DataReport(
            self.source,
            self.kind,
            self.packing,
            examples,
            truncated=sum(s.truncated for s in stats),
            dropped=sum(s.dropped for s in stats),
            tokens=tokens,
            label_tokens=sum(int(s.label_tokens.sum()) for s in stats),
            rows=sum(s.rows for s in stats),
            seq_len=self.seq_len,
            tokenize_s=time.perf_counter() - self.started,
        )
        kept = [(block, s) for block, s in zip(blocks, stats, strict=True) if s.rows]
        return StreamedData.of_blocks(
            [block for block, _ in kept],
            [s for _, s in kept],
            self.seq_len,
            fetch,
            has_labels=self.kind == "chat",
            report=report,
        )


def check_ray_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """The driver engine's options the Ray engine has not: a ValueError naming them (``cache_dir=False``,
    ``num_proc=None`` are fine)."""
    rest = dict(options)
    if rest.pop("cache_dir", None) not in (None, False):
        raise ValueError("load_dataset(engine='ray') has no tokenization cache: leave cache_dir unset")
    if rest.pop("num_proc", None) is not None:
        raise ValueError("load_dataset(engine='ray'): num_proc is the driver engine's; Ray uses the cluster's CPUs")
    return rest


RayFormat = Literal["jsonl", "parquet", "text", "datasets"]
