"""The ``raymoe`` command line (driver side, no cluster): ``raymoe export STATE_DIR OUT_DIR``.

    raymoe export STATE_DIR OUT_DIR [--max-shard-size BYTES]
        a hub checkpoint (config.json + safetensors, loadable by transformers) from a training state,
        in this process (:func:`raymoe.checkpoint.export.export_state`); prints the directory written
    raymoe export --adapter STATE_DIR OUT_DIR
        the PEFT adapter of a LoRA training state (:func:`raymoe.driver.adapter_export.export_adapter`)
    raymoe export --merge STATE_DIR OUT_DIR --base BASE [--max-shard-size BYTES]
        the hub checkpoint of BASE (the checkpoint the LoRA state was trained on) with its adapters merged in
        (:func:`raymoe.driver.adapter_export.export_merged`)

Also ``python -m raymoe.cli``. A bad state or a failed write prints one line ``raymoe export: error: ...``
on stderr and exits 2. Imports neither ``ray`` nor ``actors``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from raymoe.checkpoint.export import export_state
from raymoe.checkpoint.staging import CheckpointSaveError
from raymoe.checkpoint.training_state import TrainingStateError
from raymoe.checkpoint.writer import DEFAULT_MAX_SHARD_SIZE
from raymoe.driver.adapter_export import export_adapter, export_merged

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
    export.add_argument("state_dir", metavar="STATE_DIR", help="the training state directory (with raymoe_state.json)")
    export.add_argument("out_dir", metavar="OUT_DIR", help="the checkpoint directory to write (created or replaced)")
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
    return parser


def _export(args: argparse.Namespace) -> list[Path]:
    if args.merge:
        return export_merged(args.state_dir, args.out_dir, args.base, max_shard_size=args.max_shard_size)
    if args.adapter:
        return export_adapter(args.state_dir, args.out_dir)
    return export_state(args.state_dir, args.out_dir, max_shard_size=args.max_shard_size)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "export":
        try:
            if args.merge != (args.base is not None):
                raise ValueError(
                    "--merge needs --base BASE (the checkpoint the LoRA state was trained on), and --base goes "
                    "only with --merge"
                )
            files = _export(args)
        except (TrainingStateError, CheckpointSaveError, ValueError) as error:
            message = " ".join(str(error).split())  # one line, whatever the message holds
            print(f"raymoe export: error: {message}", file=sys.stderr)
            return EXIT_ERROR
        print(files[0].parent if files else args.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
