"""The ``raymoe`` command line (driver side, no cluster): ``raymoe export STATE_DIR OUT_DIR``, ``raymoe plan MODEL``.

    raymoe export STATE_DIR OUT_DIR [--max-shard-size BYTES]
        a hub checkpoint (config.json + safetensors, loadable by transformers) from a training state,
        in this process (:func:`raymoe.checkpoint.export.export_state`); prints the directory written
    raymoe export --adapter STATE_DIR OUT_DIR
        the PEFT adapter of a LoRA training state (:func:`raymoe.driver.adapter_export.export_adapter`)
    raymoe export --merge STATE_DIR OUT_DIR --base BASE [--max-shard-size BYTES]
        the hub checkpoint of BASE (the checkpoint the LoRA state was trained on) with its adapters merged in
        (:func:`raymoe.driver.adapter_export.export_merged`)
    STATE_DIR and OUT_DIR may be storage URLs (s3://bucket/run/states/step-00000100): a state is read where its
    commit marker points, a checkpoint written locally and uploaded (:mod:`raymoe.checkpoint.upload`)

    raymoe plan MODEL --gpus N --gpu-memory 80GB [--nodes K] [--seq-len S] [--batch B] [--lora-r R]
                [--quantized-experts mxfp4] [--precision P] [--layout tp=4,fsdp=2,ep=4,ep_mode=masking ...] [--json]
        which layouts of N GPUs fit, from config.json alone (:func:`raymoe.driver.plan.plan_memory`, on simulated
        ranks: :mod:`raymoe.rank.fake`): per-rank parameters, gradients, AdamW states (exact), the step's growth
        (estimated), the peak, communication per step, the command that launches the best one

Also ``python -m raymoe.cli``. A bad state, a failed write or a bad request prints one line
``raymoe COMMAND: error: ...`` on stderr and exits 2. Imports neither ``ray`` nor ``actors``; of the rank room only
the simulated worlds ``raymoe plan`` runs its rank function on.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from torch import nn

from raymoe.checkpoint.export import export_state
from raymoe.checkpoint.staging import CheckpointSaveError
from raymoe.checkpoint.storage import StorageUrl
from raymoe.checkpoint.training_state import TrainingStateError
from raymoe.checkpoint.writer import DEFAULT_MAX_SHARD_SIZE
from raymoe.driver.adapter_export import export_adapter, export_merged
from raymoe.driver.candidate_layouts import masked_ep_plan
from raymoe.driver.local_paths import storage_flag
from raymoe.driver.memory_plan import MemoryPlan
from raymoe.driver.plan import plan_memory
from raymoe.models.registry import build_model, parse_model_config
from raymoe.rank.fake import FakeWorlds
from raymoe.spec.config import DistributedConfig
from raymoe.spec.lora import LoraConfig, lora_config_of

EXIT_ERROR = 2  # argparse's status for bad usage; a bad state or a failed write exits with it too


def _positive_bytes(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number of bytes: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of bytes, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="raymoe", description="raymoe's command line tools (no cluster needed).")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    export = commands.add_parser(
        "export",
        help="write a hub checkpoint from a training state",
        description="Write the model of a raymoe training state (a step-<n> directory) as a hub checkpoint "
        "(config.json + safetensors) that transformers and raymoe.from_pretrained load. Runs in this process, "
        "reading one parameter at a time; files of OUT_DIR the export does not write (a tokenizer) are kept.",
    )
    export.add_argument(
        "state_dir",
        metavar="STATE_DIR",
        type=storage_flag("STATE_DIR", write=False),
        help="the training state directory (with raymoe_state.json), or a storage URL (s3://...) a state was saved to",
    )
    export.add_argument(
        "out_dir",
        metavar="OUT_DIR",
        type=storage_flag("OUT_DIR"),
        help="the checkpoint directory to write (created or replaced), or a storage URL to upload it to",
    )
    export.add_argument(
        "--max-shard-size",
        type=_positive_bytes,
        default=DEFAULT_MAX_SHARD_SIZE,
        metavar="BYTES",
        help=f"start a new safetensors shard above this many bytes (default {DEFAULT_MAX_SHARD_SIZE})",
    )
    what = export.add_mutually_exclusive_group()
    what.add_argument(
        "--adapter", action="store_true", help="a LoRA state: write its PEFT adapter (adapter_config.json + weights)"
    )
    what.add_argument(
        "--merge", action="store_true", help="a LoRA state: write BASE with the adapters merged in (needs --base)"
    )
    export.add_argument("--base", metavar="BASE", help="with --merge: the checkpoint (directory or hub id) trained on")
    _add_plan(commands)
    return parser


def _add_plan(commands: Any) -> None:
    planner = commands.add_parser(
        "plan",
        help="which layouts of N GPUs fit a model, before launching",
        description="Plan MODEL (a checkpoint directory or hub id; only config.json is read) on N GPUs: for each "
        "valid layout the largest rank's parameters, gradients and AdamW states (exact, from the same plans and "
        "shard rules the ranks apply), activations (estimated from the shapes, without and with full activation "
        "checkpointing), the peak, and the bytes a rank sends per step; the best layout that fits and its command.",
    )
    planner.add_argument("model", metavar="MODEL", help="checkpoint directory or hub id")
    planner.add_argument("--gpus", type=int, required=True, help="GPUs in all")
    planner.add_argument("--gpu-memory", required=True, help="memory of one GPU: 80GB (10^9 bytes), 80GiB, ...")
    planner.add_argument("--nodes", type=int, default=1, help="nodes the GPUs are on (default: %(default)s)")
    planner.add_argument("--seq-len", type=int, default=4096, help="tokens per row (default: %(default)s)")
    planner.add_argument(
        "--batch", type=int, help="rows of a micro-batch in all, split over the data-parallel ranks (default: one each)"
    )
    planner.add_argument("--lora-r", type=int, metavar="R", help="LoRA adapters of rank R on a frozen base")
    planner.add_argument("--lora-targets", nargs="+", metavar="NAME", help="adapted weights (default: as finetune.py)")
    planner.add_argument("--quantized-experts", choices=["mxfp4"], help="with --lora-r: MXFP4 experts kept packed")
    planner.add_argument("--precision", help="bf16-mixed, bf16-pure, fp32 (default: auto, from the checkpoint)")
    planner.add_argument("--dtype", help="compute dtype: float32, bfloat16 (default: the checkpoint's)")
    planner.add_argument(
        "--layout",
        action="append",
        metavar="SIZES",
        help="plan this layout only (repeatable): comma-separated tp=, fsdp=, ep=, dp_replicate=, cp=, pp= and "
        "ep_mode=masking|dispatch",
    )
    planner.add_argument(
        "--device", choices=["cuda", "cpu"], default="cuda", help="the ranks' device (default: %(default)s)"
    )
    planner.add_argument("--json", action="store_true", help="print the plan as JSON")


_LAYOUT_KEYS = {"tp": "tp_size", "fsdp": "fsdp_size", "ep": "ep_size", "dp_replicate": "dp_replicate_size",
                "cp": "cp_size", "pp": "pp_size"}  # fmt: skip


def parse_layout(text: str, model: nn.Module) -> DistributedConfig:
    """``tp=4,fsdp=2,ep=4,ep_mode=masking`` -> its DistributedConfig for ``model`` (the meta model: masking's ep_plan
    names its routers and experts; ``ep_mode`` defaults to the family's, token dispatch)."""
    sizes: dict[str, Any] = {}
    masked = False
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, _, value = item.partition("=")
        if key == "ep_mode" and value in ("masking", "dispatch"):
            masked = value == "masking"
        elif key in _LAYOUT_KEYS and value.isdigit() and int(value) >= 1:
            sizes[_LAYOUT_KEYS[key]] = int(value)
        else:
            raise ValueError(
                f"--layout {text!r}: {item!r} is not one of {', '.join(f'{k}=N' for k in _LAYOUT_KEYS)}, "
                "ep_mode=masking|dispatch"
            )
    if masked:
        sizes["ep_plan"] = masked_ep_plan(model)
    return DistributedConfig(**sizes)


def _meta_model(name: str) -> nn.Module:
    """The model of ``name``'s config.json on meta (what --layout's masking and --lora-r's default targets read)."""
    from raymoe.checkpoint.hub import resolve_config_file
    from raymoe.models.common.config import read_config_file

    return build_model(parse_model_config(read_config_file(resolve_config_file(name).parent)), device="meta")


def _lora(args: argparse.Namespace, meta: Callable[[], nn.Module]) -> LoraConfig | None:
    if args.lora_r is None:
        if args.lora_targets or args.quantized_experts:
            raise ValueError("--lora-targets and --quantized-experts need --lora-r (LoRA adapters on a frozen base)")
        return None
    return lora_config_of(meta(), args.lora_r, targets=args.lora_targets)


def _plan(args: argparse.Namespace) -> MemoryPlan:
    meta = functools.cache(lambda: _meta_model(args.model))  # built once, and only when a flag needs it
    layouts = [parse_layout(text, meta()) for text in args.layout] if args.layout else None
    return plan_memory(
        args.model,
        gpus=args.gpus,
        gpu_memory=args.gpu_memory,
        nodes=args.nodes,
        seq_len=args.seq_len,
        batch=args.batch,
        lora=_lora(args, meta),
        quantized_experts=args.quantized_experts,
        precision=args.precision,
        dtype=args.dtype,
        layouts=layouts,
        device=args.device,
        worlds=FakeWorlds(),
    )


def _export(args: argparse.Namespace) -> list[Path] | list[str]:
    if args.merge:
        return export_merged(args.state_dir, args.out_dir, args.base, max_shard_size=args.max_shard_size)
    if args.adapter:
        return export_adapter(args.state_dir, args.out_dir)
    return export_state(args.state_dir, args.out_dir, max_shard_size=args.max_shard_size)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "export":
            if args.merge != (args.base is not None):
                raise ValueError(
                    "--merge needs --base BASE (the checkpoint the LoRA state was trained on), and --base goes "
                    "only with --merge"
                )
            files = _export(args)
            print(Path(files[0]).parent if files and not isinstance(args.out_dir, StorageUrl) else args.out_dir)
        else:
            planned = _plan(args)
            print(json.dumps(planned.to_json(), indent=2) if args.json else planned.table())
    except (TrainingStateError, CheckpointSaveError, ValueError) as error:
        message = " ".join(str(error).split())  # one line, whatever the message holds
        print(f"raymoe {args.command}: error: {message}", file=sys.stderr)
        return EXIT_ERROR
    return 0


if __name__ == "__main__":
    sys.exit(main())
