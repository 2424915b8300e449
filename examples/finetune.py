"""Fine-tune a mixture-of-experts model with raymoe, end to end.

    python examples/finetune.py                 the embedded default: a tiny Qwen3-MoE built here (no network),
                                                trained on examples/data/corpus.txt over 4 CPU ranks
    python examples/finetune.py --model Qwen/Qwen3-30B-A3B --dataset data.jsonl --tp-size 8 ...
    python examples/finetune.py --dataset examples/data/chat.jsonl     chat data: rendered with the model's chat
                                                template, loss on the assistant's answers only, packed with
                                                each conversation attending only to itself
    python examples/finetune.py --model DIR --dataset HuggingFaceH4/no_robots --dataset-split train   a hub dataset
    ray job submit --working-dir . -- python examples/finetune.py ...      on the cluster the job runs in
    python examples/finetune.py --save-state-every 20 --resume     an auto-restarting job: each launch goes on
                                                from the newest training state in --output-dir (the first starts)
    python examples/finetune.py --lora-r 16 [--lora-alpha 32] [--lora-targets q_proj v_proj mlp.experts.down_proj]
                                                LoRA: rank-16 adapters on a frozen base (default targets: every
                                                linear layer of the attention and the fused expert weights);
                                                --output-dir gets adapter/ (PEFT's format), checkpoint/ (merged)
                                                only with --save-merged
    python examples/finetune.py --adapter runs/finetune/adapter ...   keep training a PEFT adapter directory
    python examples/finetune.py --model openai/gpt-oss-120b --lora-r 16 --quantized-experts mxfp4 ...
                                                LoRA with gpt-oss's MXFP4 experts kept packed on the ranks

The driver connects to the Ray cluster it runs in (``RAY_ADDRESS``, as ``ray job submit`` sets it;
a cluster started on this machine; else a new local instance). Bad input (a missing or empty
dataset, a sequence longer than the model allows, sizes that do not fit the cluster, a --report-to tracker that is
unknown or not installed) ends the run with one error line before any training step, as does an --output-dir that
holds an earlier run when neither --resume (continue it) nor --overwrite (start over) is given: checked before the
cluster starts.
So do LoRA flags that contradict each other or do not fit the model (--adapter with --lora-r, --lora-r 0, a target
the model lacks), and bad chat data (a conversation without an assistant turn, an unknown role, one longer than
--seq-len without --overlong truncate|drop, conversations for a checkpoint without a chat template), naming file and
row.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any, NamedTuple

import raymoe
from actors import PlacementError, RankError
from raymoe.checkpoint import resolve_config_file
from raymoe.driver.batch import check_input_ids
from raymoe.driver.candidate_layouts import masked_ep_plan
from raymoe.driver.group import RankGroup
from raymoe.driver.local_paths import path_flag, storage_flag
from raymoe.driver.tokenizer import load_chat_template
from raymoe.models import ModelConfig, build_model, load_model_config
from raymoe.models.common.lora import adapter_parameters
from raymoe.spec.lora import LoraSpec, add_adapters, lora_config_of, resolve_lora

EXAMPLES = Path(__file__).resolve().parent
DEFAULT_DATASET = EXAMPLES / "data" / "corpus.txt"
# The embedded default's layout: 4 ranks, experts split over each tp pair (token dispatch), efsdp_size=2.
DEFAULT_LAYOUT: dict[str, int] = {"tp_size": 2, "fsdp_size": 2, "ep_size": 2}
# Its load balancing: the aux loss per layer (the pooled one of the checkpoint's convention leaves single layers
# at max/mean 2 on this model; per layer they end near 1.1).
EMBEDDED_BALANCE = "layer_aux"
EMBEDDED_MODEL = "embedded tiny Qwen3-MoE"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="finetune.py",
        description="Fine-tune a (mixture-of-experts) causal LM sharded over Ray rank actors.",
    )
    data = parser.add_argument_group("model and data")
    data.add_argument("--model", help="checkpoint directory or hub id (default: build the embedded tiny Qwen3-MoE)")
    data.add_argument(
        "--dataset",
        type=Path,
        default=DEFAULT_DATASET,
        help=".jsonl or .parquet (text, or chat: 'messages' or 'prompt'/'completion'), a text file, pre-tokenized "
        ".npy, or a Hugging Face dataset (hub id or local directory; needs raymoe[datasets]) (default: %(default)s)",
    )
    data.add_argument("--dataset-split", default="train", help="split of a Hugging Face dataset (default: %(default)s)")
    data.add_argument("--dataset-config", help="configuration (subset) name of a Hugging Face dataset")
    data.add_argument(
        "--text-field", default="text", help="field holding a document's text in records (default: %(default)s)"
    )
    data.add_argument(
        "--messages-field", default="messages", help="field holding a conversation's messages (default: %(default)s)"
    )
    data.add_argument(
        "--prompt-field", default="prompt", help="prompt field of instruction pairs (default: %(default)s)"
    )
    data.add_argument(
        "--completion-field", default="completion", help="completion field of instruction pairs (default: %(default)s)"
    )
    data.add_argument(
        "--chat-template",
        type=Path,
        help="a .jinja chat template (or a tokenizer_config.json holding one) to use instead of the checkpoint's",
    )
    data.add_argument(
        "--loss-on",
        choices=("assistant", "all"),
        default="assistant",
        help="chat data: train on the assistant's answers (and their end token) only, or on every token "
        "(default: %(default)s)",
    )
    data.add_argument(
        "--packing",
        choices=("document", "plain"),
        default="document",
        help="document: each document/conversation attends only to itself, positions restart at each; plain: "
        "attention crosses documents in a row (default: %(default)s)",
    )
    data.add_argument(
        "--overlong",
        choices=("error", "truncate", "drop"),
        default="error",
        help="a conversation longer than --seq-len: stop with an error naming it, keep its first --seq-len "
        "tokens, or leave it out (default: %(default)s)",
    )
    data.add_argument("--seq-len", type=int, default=128, help="tokens per packed sequence (default: %(default)s)")
    data.add_argument("--num-proc", type=int, help="tokenizing processes (default: one per CPU for large data)")
    data.add_argument(
        "--data-engine",
        choices=("driver", "ray"),
        default="driver",
        help="driver: tokenize and pack in this process (cached); ray: as Ray Data operators on the cluster's CPUs, "
        "the packed rows left in Ray's object store, where the ranks read them (default: %(default)s)",
    )
    data.add_argument(
        "--pack-window",
        type=int,
        help="examples packed together (default: the whole dataset with --data-engine driver, 10000 with ray)",
    )
    data.add_argument(
        "--cache-dir",
        type=path_flag("--cache-dir"),
        help="where tokenized data is cached by content hash (default: $RAYMOE_CACHE_DIR or ~/.cache/raymoe/tokenized)",
    )
    data.add_argument("--no-cache", action="store_true", help="tokenize afresh and cache nothing")
    data.add_argument(
        "--eval-fraction", type=float, default=0.1, help="share of sequences held out for eval (default: %(default)s)"
    )
    data.add_argument(
        "--dtype", help="compute dtype on the ranks: float32, bfloat16 or float16 (default: the checkpoint's)"
    )
    data.add_argument(
        "--precision",
        choices=["auto", "bf16-mixed", "fp32", "bf16-pure"],
        default="auto",
        help="where weights, gradients and AdamW states are held: auto (default) is bf16-mixed for a bf16 "
        "checkpoint (fp32 masters, bf16 compute) and fp32 for an fp32 one; bf16-pure loses small updates",
    )

    layout = parser.add_argument_group(f"layout (unset sizes come from DEFAULT_LAYOUT: {DEFAULT_LAYOUT})")
    layout.add_argument("--tp-size", type=int, help="tensor-parallel degree")
    layout.add_argument("--fsdp-size", type=int, help="FSDP shard degree")
    layout.add_argument("--ep-size", type=int, help="expert-parallel degree")
    layout.add_argument(
        "--ep-mode",
        choices=("dispatch", "masking"),
        help="expert parallelism by token dispatch (the families' default; any --ep-size that divides fsdp x tp) or "
        "by masking (routers mask, experts sum over the tp group; needs --ep-size equal to --tp-size)",
    )
    layout.add_argument("--dp-replicate-size", type=int, help="HSDP replicas (nodes)")
    layout.add_argument(
        "--cp-size",
        type=int,
        help="context-parallel degree: ranks that split every sequence (long sequences; --seq-len a multiple of "
        "2 * cp-size)",
    )
    layout.add_argument(
        "--cp-mode",
        choices=("ring", "all_to_all"),
        help="attention across the split: key/value blocks around the ring (any head count) or all-to-all between "
        "sequence and heads (heads per tp rank divisible by --cp-size) (default: ring)",
    )
    layout.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="Megatron-style sequence parallelism inside TP: norms and the residual stream split along the sequence "
        "over the tp group (needs --tp-size > 1)",
    )
    layout.add_argument(
        "--activation-checkpointing",
        choices=("none", "full", "selective"),
        default="none",
        help="recompute each decoder layer's activations in backward: all (full) or all but matmul and attention "
        "outputs (selective); less memory, same numbers (default: %(default)s)",
    )
    layout.add_argument(
        "--fsdp-reshard-after-forward",
        choices=("auto", "always", "never"),
        default="auto",
        help="FSDP2 units free their gathered weights after forward and gather them again in backward (always), keep "
        "them until backward (never: one all-gather a step instead of two, the gathered model's memory more), or "
        "keep them where they take at most 1/8 of the free device memory (auto) (default: %(default)s)",
    )
    layout.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="torch.compile each decoder block on the ranks (default: on CUDA GPUs, off on CPU); --no-compile keeps "
        "them eager",
    )
    layout.add_argument(
        "--cpus-per-rank", type=float, default=1.0, help="CPUs reserved per rank actor (default: %(default)s)"
    )

    train = parser.add_argument_group("training")
    train.add_argument("--steps", type=int, default=80, help="optimizer steps (default: %(default)s)")
    train.add_argument(
        "--global-batch-size", type=int, default=8, help="sequences per optimizer step (default: %(default)s)"
    )
    train.add_argument(
        "--grad-accum", type=int, default=1, help="micro-batches per step and data-parallel rank (default: %(default)s)"
    )
    train.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default: %(default)s)")
    train.add_argument("--warmup-steps", type=int, help="linear warmup steps (default: a tenth of --steps)")
    train.add_argument(
        "--min-lr-ratio", type=float, default=0.1, help="final lr = lr * this (cosine decay) (default: %(default)s)"
    )
    train.add_argument("--weight-decay", type=float, default=0.01, help="(default: %(default)s)")
    train.add_argument(
        "--max-grad-norm", type=float, default=1.0, help="clip threshold; 0 turns clipping off (default: %(default)s)"
    )
    balance = parser.add_argument_group("load balancing (mixture-of-experts models)")
    balance.add_argument(
        "--balance",
        help="auto (the checkpoint's convention: aux loss iff output_router_logits), aux, layer_aux, bias, none, or "
        f"an aux loss with bias such as aux,bias (default: auto; {EMBEDDED_BALANCE} for the embedded model)",
    )
    balance.add_argument(
        "--router-aux-loss-coef",
        type=float,
        help="aux loss coefficient (default: the checkpoint's router_aux_loss_coef)",
    )
    balance.add_argument(
        "--bias-update-rate",
        type=float,
        default=1e-3,
        help="bias balancing step per optimizer step (default: %(default)s)",
    )
    balance.add_argument(
        "--capacity-factor",
        type=float,
        help="drop pairs beyond this multiple of an expert's fair share of a sequence (default: none)",
    )
    train.add_argument(
        "--eval-every",
        type=int,
        default=20,
        help="steps between evaluations; 0: only before/after (default: %(default)s)",
    )
    train.add_argument(
        "--save-every",
        type=int,
        default=0,
        help="steps between checkpoints (checkpoint/; with LoRA adapter/); 0: only at the end (default: %(default)s)",
    )
    train.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    train.add_argument(
        "--output-dir",
        type=storage_flag("--output-dir"),
        default=Path("runs/finetune"),
        help="checkpoint (or LoRA adapter), metrics, plot: a local path or a storage URL such as s3://bucket/run "
        "(default: %(default)s)",
    )
    train.add_argument("--no-progress", action="store_true", help="no progress bar")
    train.add_argument(
        "--report-to",
        nargs="+",
        default=["none"],
        metavar="TRACKER",
        help="experiment trackers each step, the config and the plot go to: none, all (each installed), tensorboard, "
        "mlflow, wandb, trackio (pip install 'raymoe[NAME]'; settings from their environment variables, e.g. "
        "MLFLOW_TRACKING_URI, WANDB_PROJECT, WANDB_MODE=offline) (default: none)",
    )
    train.add_argument("--run-name", help="the run's name in the trackers (default: --output-dir's name)")
    train.add_argument(
        "--logging-dir", type=path_flag("--logging-dir"), help="TensorBoard's event files (default: OUTPUT_DIR/runs)"
    )

    lora = parser.add_argument_group("LoRA adapters (the base frozen, only the adapters train; PEFT's format)")
    lora.add_argument(
        "--lora-r",
        type=int,
        metavar="N",
        help="train rank-N LoRA adapters instead of every weight: OUTPUT_DIR/adapter is then the PEFT adapter "
        "directory, and OUTPUT_DIR/checkpoint is written only with --save-merged",
    )
    lora.add_argument(
        "--lora-alpha",
        type=number,
        metavar="ALPHA",
        help="the adapters' scale is ALPHA / r (default: 2 x --lora-r)",
    )
    lora.add_argument(
        "--lora-targets",
        nargs="+",
        metavar="NAME",
        help="the weights that get adapters: linear layers by name (q_proj, o_proj, ..., all-linear) and, by a name "
        "with an 'experts.' part, fused expert weights (mlp.experts.gate_up_proj, mlp.experts.down_proj) "
        "(default: every linear layer of the attention and, on MoE models, both expert weights)",
    )
    lora.add_argument(
        "--adapter",
        type=path_flag("--adapter"),
        metavar="DIR",
        help="keep training this PEFT adapter directory (its r, lora_alpha and targets; not with --lora-r, "
        "--lora-alpha or --lora-targets)",
    )
    lora.add_argument(
        "--quantized-experts",
        choices=["mxfp4"],
        help="with LoRA, on a checkpoint storing its experts in MXFP4 (gpt-oss): keep the frozen experts packed on the "
        "ranks (4.25 bits a weight), dequantized inside each projection",
    )
    lora.add_argument(
        "--save-merged",
        action="store_true",
        help="with LoRA: also write OUTPUT_DIR/checkpoint, the hub checkpoint of the merged weights W + alpha / r B A",
    )

    state = parser.add_argument_group("training state and resuming")
    state.add_argument(
        "--save-state-every",
        type=int,
        default=0,
        help="steps between training states (weights, optimizer, RNG, data position) in OUTPUT_DIR/states/step-N, "
        "what --resume continues from; 0: none (default: %(default)s)",
    )
    state.add_argument(
        "--keep-last",
        type=int,
        default=2,
        help="training states kept (older ones removed after each save); 0 keeps all (default: %(default)s)",
    )
    state.add_argument(
        "--async-save", action="store_true", help="write each state while training goes on (the next save waits)"
    )
    state.add_argument(
        "--max-failures",
        type=int,
        default=0,
        help="restart ranks that die or hang up to this many times, going on from the newest state (default: "
        "%(default)s: the first failure ends the run)",
    )
    start = state.add_mutually_exclusive_group()
    start.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in --output-dir from its newest training state: the step, the learning-rate "
        "schedule, the data order and position; metrics.jsonl is appended to. With no state yet it starts at step 0 "
        "(so an auto-restarting job can always pass it). The layout may differ from the saved run's",
    )
    start.add_argument(
        "--resume-from",
        type=path_flag("--resume-from"),
        metavar="STATE_DIR",
        help="continue from this training state directory instead",
    )
    start.add_argument(
        "--overwrite",
        action="store_true",
        help="start over in an --output-dir that holds an earlier run: its states are removed, its metrics "
        "replaced and its checkpoint overwritten (without --resume or --overwrite such a directory is refused)",
    )
    train.add_argument("--debug", action="store_true", help="print a failing rank's whole traceback")
    return parser.parse_args(argv)


def number(text: str) -> int | float:
    """An int when the value is whole (``--lora-alpha 32`` is written to adapter_config.json as PEFT writes it)."""
    value = float(text)
    return int(value) if value.is_integer() else value


def layout_of(args: argparse.Namespace) -> dict[str, Any]:
    """DEFAULT_LAYOUT with the sizes given on the command line replacing its entries (and activation
    checkpointing, sequence parallelism, FSDP2's reshard choice and masked EP, when asked for)."""
    given = {
        "tp_size": args.tp_size,
        "fsdp_size": args.fsdp_size,
        "ep_size": args.ep_size,
        "dp_replicate_size": args.dp_replicate_size,
        "cp_size": args.cp_size,
        "cp_mode": args.cp_mode,
    }
    layout: dict[str, Any] = {
        **DEFAULT_LAYOUT,
        **{name: size for name, size in given.items() if size is not None},
    }
    if args.activation_checkpointing != "none":
        layout["activation_checkpointing"] = args.activation_checkpointing
    if args.sequence_parallel:
        layout["enable_sequence_parallel"] = True
    if args.fsdp_reshard_after_forward != "auto":
        layout["fsdp_reshard_after_forward"] = args.fsdp_reshard_after_forward
    return layout


def prepare_model(args: argparse.Namespace) -> tuple[str, raymoe.TextTokenizer | None]:
    """The checkpoint to load and its tokenizer; the embedded tiny model is built under ``--output-dir``."""
    if args.model is None:
        local = isinstance(args.output_dir, Path)  # a URL run builds it in a temporary directory of this node
        base = args.output_dir / "base-model" if local else Path(tempfile.mkdtemp(prefix="raymoe-tiny-"))
        path = raymoe.build_tiny_checkpoint(base, seed=args.seed)
        return str(path), raymoe.load_tokenizer(path)  # byte-level, with its ChatML template
    if args.dataset.suffix == ".npy":
        return args.model, None  # pre-tokenized data needs no tokenizer
    return args.model, raymoe.load_tokenizer(args.model)


def check_model_fits(model: str, config: raymoe.TrainerConfig) -> ModelConfig:
    """The model's config.json, read once, and the load-balancing rules against it: before any data is read."""
    model_config = load_model_config(resolve_config_file(model).parent)
    config.balance_options().resolve(model_config)
    return model_config


def check_seq_len(seq_len: int, model_config: ModelConfig) -> None:
    max_positions = model_config.max_position_embeddings
    if seq_len > max_positions:
        raise ValueError(
            f"--seq-len={seq_len} exceeds the model's max_position_embeddings={max_positions}; use at most that"
        )


class Lora(NamedTuple):
    """A LoRA run: what ``from_pretrained(lora=...)`` gets (a LoraConfig, or an adapter directory), its resolved
    targets, and the parameter counts of the whole model (not per rank)."""

    request: raymoe.LoraConfig | str
    spec: LoraSpec
    trainable: int
    frozen: int

    def describe(self) -> str:
        config = self.spec.config
        modules = (
            config.target_modules if isinstance(config.target_modules, str) else ", ".join(config.target_modules or ())
        )
        names = ", ".join(filter(None, [modules, ", ".join(config.target_parameters)]))
        source = f"adapter {self.request}" if isinstance(self.request, str) else "new adapters"
        total = self.trainable + self.frozen
        return (
            f"LoRA ({source}): r {config.r}, lora_alpha {config.lora_alpha} on {names}: {len(self.spec.targets)} "
            f"adapted weights, {self.trainable:,} trainable parameters ({self.trainable / total:.2%} of {total:,})"
        )


def uses_lora(args: argparse.Namespace) -> bool:
    return args.lora_r is not None or args.adapter is not None


def check_lora_flags(args: argparse.Namespace) -> None:
    """The LoRA flags against each other, before anything is read."""
    given = (("--lora-r", args.lora_r), ("--lora-alpha", args.lora_alpha), ("--lora-targets", args.lora_targets))
    fresh = [flag for flag, value in given if value is not None]
    if args.adapter is not None and fresh:
        raise ValueError(
            f"--adapter {args.adapter} trains the adapter in that directory with its own r, lora_alpha and targets "
            f"(its adapter_config.json); drop {', '.join(fresh)}, or drop --adapter to train new adapters"
        )
    if args.lora_r is None and fresh:
        raise ValueError(f"{', '.join(fresh)} without --lora-r: --lora-r N turns LoRA on (new rank-N adapters)")
    if args.quantized_experts is not None and not uses_lora(args):
        raise ValueError(
            f"--quantized-experts {args.quantized_experts} keeps the frozen experts of a LoRA run packed; give "
            "--lora-r N or --adapter DIR (full fine-tuning trains the experts in full precision)"
        )
    if args.save_merged and not uses_lora(args):
        raise ValueError(
            "--save-merged writes the merged weights of a LoRA run; give --lora-r N or --adapter DIR (without LoRA, "
            "checkpoint/ holds the whole trained model anyway)"
        )


def lora_of(args: argparse.Namespace, model_config: ModelConfig) -> Lora | None:
    """The LoRA request of the flags (None: no LoRA), resolved against the model on the driver: a bad value, a
    target the model does not have or an adapter directory that is none is a ValueError naming it, before any
    cluster starts."""
    if not uses_lora(args):
        return None
    model = build_model(model_config)  # on meta: names and shapes only
    request: raymoe.LoraConfig | str
    if args.adapter is not None:
        request = str(args.adapter.expanduser().absolute())  # the ranks may run in another directory
    else:
        request = lora_config_of(model, args.lora_r, args.lora_alpha, args.lora_targets)
    spec = resolve_lora(request, model)
    add_adapters(model, spec)
    trainable = sum(param.numel() for _, param in adapter_parameters(model))
    return Lora(request, spec, trainable, sum(param.numel() for param in model.parameters()) - trainable)


def trainer_config(args: argparse.Namespace) -> raymoe.TrainerConfig:
    return raymoe.TrainerConfig(
        output_dir=args.output_dir,
        steps=args.steps,
        global_batch_size=args.global_batch_size,
        gradient_accumulation_steps=args.grad_accum,
        lr=args.lr,
        warmup_steps=args.warmup_steps,
        min_lr_ratio=args.min_lr_ratio,
        weight_decay=args.weight_decay,
        max_grad_norm=args.max_grad_norm or None,
        balance=args.balance or (EMBEDDED_BALANCE if args.model is None else "auto"),
        router_aux_loss_coef=args.router_aux_loss_coef,
        bias_update_rate=args.bias_update_rate,
        capacity_factor=args.capacity_factor,
        eval_every=args.eval_every or None,
        save_every=args.save_every or None,
        save_checkpoint=not uses_lora(args) or args.save_merged,
        save_adapter=uses_lora(args),
        seed=args.seed,
        progress=not args.no_progress,
        save_state_every=args.save_state_every or None,
        keep_last=args.keep_last or None,
        async_save=args.async_save,
        resume_from="latest" if args.resume else args.resume_from,
        overwrite=args.overwrite,
        max_failures=args.max_failures,
        report_to=args.report_to,
        run_name=args.run_name,
        logging_dir=args.logging_dir,
    )


def run(args: argparse.Namespace, world: RankGroup | None = None) -> tuple[raymoe.TrainSummary, Lora | None]:
    """The run ``args`` describe. ``world``: ranks already started (``raymoe.start_world``: a notebook's, a test
    session's) to load onto instead of starting this run's own; its size is the layout's, --cpus-per-rank is then
    its own, and it stays up after the run (the model is unloaded)."""
    # Everything checkable without a cluster comes first: the config, the output directory (an earlier run there
    # is resumed, overwritten or refused), the LoRA flags, the data, the sequence length.
    check_lora_flags(args)
    sizes = layout_of(args)
    layout = raymoe.DistributedConfig(**sizes)
    layout.check_sequence_length(args.seq_len)  # context / sequence parallelism split every row: before any data
    config = trainer_config(args)
    resume = config.check_output_dir()
    if resume is not None:
        print(f"resuming from {resume}")
    model_source, tokenizer = prepare_model(args)
    if args.chat_template is not None and tokenizer is not None:  # trained with it, saved with the checkpoint
        tokenizer = tokenizer.with_chat_template(load_chat_template(args.chat_template, tokenizer.special_tokens))
    model_config = check_model_fits(model_source, config)
    if args.ep_mode == "masking":  # the routers and experts of this model, by their paths
        layout = raymoe.DistributedConfig(**sizes, ep_plan=masked_ep_plan(build_model(model_config, device="meta")))
    check_seq_len(args.seq_len, model_config)
    lora = lora_of(args, model_config)
    data = load_data(args, tokenizer)
    check_seq_len(data.seq_len, model_config)  # packed .npy rows bring their own length
    layout.check_sequence_length(data.seq_len)
    # Pre-tokenized data may hold any integer: checked here, before Ray starts, as the handle would later (rows in
    # Ray's object store were tokenized by the model's tokenizer; the Trainer checks their id range).
    if isinstance(data, raymoe.PackedData):
        check_input_ids(data.input_ids, model_config.vocab_size, f"dataset {args.dataset}")
    train_data, eval_data = data.split(args.eval_fraction)
    name = EMBEDDED_MODEL if args.model is None else args.model
    print(f"model {name}, layout {sizes}, {data.num_sequences} sequences of {data.seq_len} tokens from {args.dataset}")
    if data.report is not None:
        print(f"data: {data.report.summary()}")
    if lora is not None:
        print(lora.describe())
    with raymoe.from_pretrained(
        model_source,
        distributed_config=layout,
        dtype=args.dtype,
        precision=args.precision,
        **({"cpus_per_rank": args.cpus_per_rank} if world is None else {"world": world}),
        lora=lora.request if lora is not None else None,
        quantized_experts=args.quantized_experts,
        compile=args.compile,
    ) as model:
        print(model.describe())
        trainer = raymoe.Trainer(model, train_data, config, eval_data=eval_data, tokenizer=tokenizer)
        return trainer.fit(), lora


def load_data(
    args: argparse.Namespace, tokenizer: raymoe.TextTokenizer | None
) -> raymoe.PackedData | raymoe.StreamedData:
    """The dataset, tokenized (chat data rendered with the chat template) and packed as the options say; with
    ``--data-engine ray`` on the cluster, the rows left in Ray's object store."""
    window = {} if args.pack_window is None else {"pack_window": args.pack_window}
    return raymoe.load_dataset(
        args.dataset,
        args.seq_len,
        tokenizer,
        engine=args.data_engine,
        **window,
        text_field=args.text_field,
        messages_field=args.messages_field,
        prompt_field=args.prompt_field,
        completion_field=args.completion_field,
        packing=args.packing,
        loss_on=args.loss_on,
        overlong=args.overlong,
        split=args.dataset_split,
        dataset_config=args.dataset_config,
        cache_dir=False if args.no_cache else args.cache_dir,  # a cache dir or --num-proc: engine='ray' says no
        num_proc=args.num_proc,
        progress=not args.no_progress,
    )


def print_summary(summary: raymoe.TrainSummary, lora: Lora | None = None) -> None:
    def loss(value: float | None) -> str:
        return f"{value:.3f}" if value is not None else "-"

    if lora is None:
        saved: list[tuple[str, Any]] = [("checkpoint", summary.checkpoint or "not saved")]
    else:
        config = lora.spec.config
        saved = [
            ("trainable", f"{lora.trainable:,} parameters (LoRA r {config.r}, lora_alpha {config.lora_alpha})"),
            ("adapter", summary.adapter or "not saved"),
            ("checkpoint", summary.checkpoint or "not saved (--save-merged writes the merged model)"),
        ]
    lines: list[tuple[str, Any]] = [
        ("steps", summary.steps),
        *([("resumed", summary.resumed_from)] if summary.resumed_from is not None else []),
        ("train loss", f"{loss(summary.first_loss)} -> {loss(summary.last_loss)} (first -> last step)"),
        ("eval loss", f"{loss(summary.eval_loss_before)} -> {loss(summary.eval_loss_after)} (before -> after)"),
        ("throughput", f"{summary.tokens_per_s:.0f} label tokens/s ({summary.num_tokens} tokens)"),
        *([("compile", compile_line(summary))] if summary.compile_s or summary.eval_compile_s else []),
        *saved,
        ("state", summary.state or "not saved"),
        ("metrics", summary.metrics_file),
        ("plot", summary.plot_file or "-"),
    ]
    print("\n".join(f"{key:>11}  {value}" for key, value in lines))


def compile_line(summary: raymoe.TrainSummary) -> str:
    """Where the run spent compiling the decoder blocks (new batch shapes); the throughput leaves it out."""
    return (
        f"{summary.compile_s:.1f} s in training steps, {summary.eval_compile_s:.1f} s in evaluations "
        "(decoder blocks, for batch shapes they had not run; not in the throughput)"
    )


def main(argv: list[str] | None = None, world: RankGroup | None = None) -> int:
    """The command line; ``world`` as in :func:`run`."""
    args = parse_args(argv)
    try:
        summary, lora = run(args, world)
    except (ValueError, PlacementError) as exc:
        # Bad input, or sizes the cluster cannot host: raised on the driver before any training step.
        print(f"finetune.py: error: {exc}", file=sys.stderr)
        return 2
    except RankError as exc:
        # A rank failed while running: which rank, where and why in one line; its traceback with --debug.
        detail = str(exc) if args.debug else f"{str(exc).splitlines()[0]} (--debug shows the rank's traceback)"
        print(f"finetune.py: rank failure: {detail}", file=sys.stderr)
        return 1
    except raymoe.TrainingFailed as exc:
        # More failures than --max-failures: the cause and the newest state to resume from, in one line.
        print(f"finetune.py: training failed: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as exc:
        # Ctrl-C / SIGTERM: the Trainer stopped at a step boundary (and saved the state), or a second one stopped at
        # once; leaving `with from_pretrained(...)` has freed every rank either way.
        print(f"finetune.py: interrupted: {exc or 'stopped at once'}", file=sys.stderr)
        return 130
    print_summary(summary, lora)
    return 0


if __name__ == "__main__":
    sys.exit(main())
