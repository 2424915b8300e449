"""Generate text with raymoe from the command line, streaming the tokens as they come.

    python examples/generate.py --model runs/finetune/checkpoint --prompt "The river "
    python examples/generate.py --model openai/gpt-oss-20b --tp-size 4 --ep-size 4 --prompt "..." --do-sample
    python examples/generate.py --prompt "a" --prompt "longer prompt" --max-new-tokens 32    several prompts

One prompt is streamed token by token; several (of any lengths, any number on any layout) are
printed when all are done. The checkpoint's tokenizer (``tokenizer.json``) encodes and decodes; the
default model is the embedded tiny Qwen3-MoE (random weights: the text is noise, the mechanics are
real). Bad input ends the run with one error line before any rank is asked.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import raymoe
from actors import PlacementError
from raymoe.checkpoint import resolve_config_file
from raymoe.driver.group import RankGroup
from raymoe.driver.local_paths import path_flag
from raymoe.driver.prompts import prompt_batch
from raymoe.models import load_model_config
from raymoe.models.common.generation import SamplingConfig


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="generate.py", description="Generate with a model sharded over Ray ranks.")
    parser.add_argument("--model", help="checkpoint directory or hub id (default: the embedded tiny Qwen3-MoE)")
    parser.add_argument("--prompt", action="append", required=True, help="a prompt; repeat for several")
    parser.add_argument("--max-new-tokens", type=int, default=48, help="(default: %(default)s)")
    parser.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    parser.add_argument("--temperature", type=float, default=1.0, help="(default: %(default)s)")
    parser.add_argument("--top-k", type=int, help="sample among the k most likely tokens")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="the same seed gives the same tokens on any layout")
    parser.add_argument("--tp-size", type=int, default=1, help="(default: %(default)s)")
    parser.add_argument("--fsdp-size", type=int, default=1, help="(default: %(default)s)")
    parser.add_argument("--ep-size", type=int, help="expert-parallel degree")
    parser.add_argument("--cpus-per-rank", type=float, default=1.0, help="(default: %(default)s)")
    parser.add_argument(
        "--precision",
        choices=["auto", "bf16-mixed", "fp32", "bf16-pure"],
        default="auto",
        help="auto (default): the checkpoint's dtype (fp32 masters for a bf16 one); bf16-pure holds half the "
        "bytes of bf16-mixed and gives the same tokens",
    )
    parser.add_argument(
        "--output-dir",
        type=path_flag("--output-dir"),
        default=Path("runs/generate"),
        help="where the embedded model is built",
    )
    return parser.parse_args(argv)


def run(args: argparse.Namespace, world: RankGroup | None = None) -> list[list[int]]:
    """Print the continuations; returns each prompt's token ids followed by its continuation's. ``world``: ranks
    already started (``raymoe.start_world``) to load onto instead of starting this run's own; its size is the
    layout's, --cpus-per-rank is then its own, and it stays up after the run (the model is unloaded)."""
    if args.model is None:
        source = str(raymoe.build_tiny_checkpoint(args.output_dir / "base-model"))
        tokenizer = raymoe.TextTokenizer.byte_level()
    else:
        source, tokenizer = args.model, raymoe.load_tokenizer(args.model)
    prompts = [tokenizer.encode(text) for text in args.prompt]
    layout = {"tp_size": args.tp_size, "fsdp_size": args.fsdp_size, "ep_size": args.ep_size}
    options = {
        "do_sample": args.do_sample,
        "temperature": args.temperature,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "seed": args.seed,
    }
    # bad prompts (an empty one, ids the vocabulary lacks) and sampling options end the run here, before any rank
    # starts; the handle would refuse them too, with ranks already up
    prompt_batch(prompts, None, load_model_config(resolve_config_file(source).parent).vocab_size, pad_id=0)
    SamplingConfig(**options)
    placement = {"cpus_per_rank": args.cpus_per_rank} if world is None else {"world": world}
    with raymoe.from_pretrained(source, distributed_config=layout, precision=args.precision, **placement) as model:
        if len(prompts) > 1:
            rows = model.generate(prompts, args.max_new_tokens, **options)
            assert isinstance(rows, list)  # lists in, lists out
            print("\n---\n".join(tokenizer.decode(row) for row in rows))
            return rows
        print(args.prompt[0], end="", flush=True)
        new: list[int] = []
        shown = ""
        for step in model.generate_stream(prompts, args.max_new_tokens, **options):
            if step[0] is not None:
                new.append(step[0])
                shown = print_new_text(tokenizer.decode(new), shown)
        print(tokenizer.decode(new)[len(shown) :])
        return [prompts[0] + new]


def print_new_text(text: str, shown: str) -> str:
    """Print what ``text`` adds to ``shown``, unless it ends inside a character (a token that is part of a
    multi-byte character decodes to U+FFFD until the rest arrives); returns what is shown now."""
    if text.endswith("\ufffd"):
        return shown
    print(text[len(shown) :], end="", flush=True)
    return text


def main(argv: list[str] | None = None, world: RankGroup | None = None) -> int:
    """The command line; ``world`` as in :func:`run`."""
    args = parse_args(argv)
    try:
        run(args, world)
    except (ValueError, PlacementError) as exc:
        print(f"generate.py: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
