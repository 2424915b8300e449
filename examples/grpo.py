"""GRPO with raymoe as the RL backend: group sampling, a verifiable reward, router replay, PPO's clipped loss.

    python examples/grpo.py                        the embedded tiny Qwen3-MoE (random weights) on 4 CPU ranks
    python examples/grpo.py --steps 120 --group-size 8 --layout tp_size=2,fsdp_size=2,ep_size=2
    python examples/grpo.py --no-replay            the same run, the routers recomputing their choices in training
    python examples/grpo.py --model DIR ...        any checkpoint with a byte-level-compatible tokenizer

The task: reply to ``"cab="`` with the prompt's letters reversed (``"bac"``) and an end-of-text; the reward is
the fraction of the answer's positions that are right (eos included). The untrained model answers noise (reward
about 0). Each step:

    prompts (P of them) --generate(do_sample, return_routed_experts)--> G completions each, their routes
    rewards -> advantages (reward - group mean) / (group std + 1e-4), one per completion, on its tokens
    old_logprobs = logprobs(rows, routed_experts=routes)            the sampling policy, replayed
    for each of --mini-batches: train_step(loss="ppo", advantages, old_logprobs, loss_mask, routed_experts)

From the second mini-batch on the policy has moved: the ratio leaves 1 and the clip acts. ``--output-dir`` gets
``metrics.jsonl`` (reward mean, loss, clip fraction, approx-KL, grad norm per step), ``metrics.png`` (the reward
curve) and the model. Bad input (a layout that does not fit, a bad size) ends the run with one error line.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

import raymoe
from actors import PlacementError
from raymoe.driver.group import RankGroup
from raymoe.driver.local_paths import path_flag
from raymoe.driver.metrics import METRICS_FILE, MetricsLog

DEFAULT_LAYOUT = "tp_size=2,fsdp_size=2,ep_size=2"
LETTERS = "abcd"
EOS = 256  # the byte-level tokenizer's <|endoftext|>


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="grpo.py", description="GRPO on a model sharded over Ray ranks.")
    parser.add_argument("--model", help="checkpoint directory (default: the embedded tiny Qwen3-MoE, built here)")
    parser.add_argument("--layout", default=DEFAULT_LAYOUT, help="DistributedConfig fields (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=150, help="rollout + update rounds (default: %(default)s)")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step (default: %(default)s)")
    parser.add_argument("--group-size", type=int, default=8, help="completions per prompt (default: %(default)s)")
    parser.add_argument("--mini-batches", type=int, default=2, help="updates per rollout (default: %(default)s)")
    parser.add_argument("--prompt-letters", type=int, default=3, help="letters per prompt (default: %(default)s)")
    parser.add_argument("--lr", type=float, default=2e-3, help="(default: %(default)s)")
    parser.add_argument("--clip-low", type=float, default=0.2, help="(default: %(default)s)")
    parser.add_argument("--clip-high", type=float, default=0.28, help="DAPO's upper clip (default: %(default)s)")
    parser.add_argument("--temperature", type=float, default=1.3, help="sampling temperature (default: %(default)s)")
    parser.add_argument("--no-replay", action="store_true", help="train without the rollout's routes")
    parser.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    parser.add_argument("--cpus-per-rank", type=float, default=0.5, help="(default: %(default)s)")
    parser.add_argument(
        "--output-dir", type=path_flag("--output-dir"), default=Path("runs/grpo"), help="(default: %(default)s)"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    for name in ("steps", "prompts", "group_size", "mini_batches", "prompt_letters"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.group_size < 2:
        parser.error(f"--group-size must be >= 2 (advantages compare completions of one prompt), got {args.group_size}")
    args.output_dir = args.output_dir.expanduser().absolute()
    return args


def parse_layout(text: str) -> dict[str, Any]:
    """``"tp_size=2,fsdp_size=2"`` -> ``{"tp_size": 2, "fsdp_size": 2}`` (ints where they parse)."""
    layout: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--layout {text!r}: each item is name=value, got {item!r}")
        layout[key.strip()] = int(value) if value.strip().lstrip("-").isdigit() else value.strip()
    return layout


def task(rng: random.Random, letters: int) -> tuple[list[int], list[int]]:
    """A prompt ``"cab="`` as byte ids and the answer it asks for: ``"bac"`` then end-of-text."""
    word = "".join(rng.choice(LETTERS) for _ in range(letters))
    return list(f"{word}=".encode()), [*word[::-1].encode(), EOS]


def reward(completion: list[int], answer: list[int]) -> float:
    """The fraction of the answer's positions the completion got right (a missing position is wrong)."""
    return sum(1 for got, want in zip(completion, answer, strict=False) if got == want) / len(answer)


def rollout_batch(
    rows: list[list[int]], prompt_len: int, routes: list[torch.Tensor] | None, advantages: list[float]
) -> dict[str, torch.Tensor | None]:
    """Right-padded ``[N, W]`` rows, their mask, the completion tokens' mask, per-token advantages and routes."""
    width = max(len(row) for row in rows)
    n = len(rows)
    ids = torch.full((n, width), EOS + 1, dtype=torch.int64)  # <|pad|>
    mask = torch.zeros(n, width, dtype=torch.int64)
    loss_mask = torch.zeros(n, width, dtype=torch.bool)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = 1
        loss_mask[i, prompt_len : len(row)] = True
    adv = torch.tensor(advantages, dtype=torch.float32)[:, None].expand(n, width).contiguous()
    padded = None
    if routes is not None:
        padded = torch.zeros((n, width, *routes[0].shape[1:]), dtype=torch.int16)
        for i, r in enumerate(routes):
            padded[i, : r.shape[0]] = r
    return {"input_ids": ids, "attention_mask": mask, "loss_mask": loss_mask, "advantages": adv, "routes": padded}


def group_advantages(rewards: list[float], group: int) -> list[float]:
    """GRPO's advantages: each completion's reward minus its group's mean, over the group's std (+1e-4)."""
    out: list[float] = []
    for start in range(0, len(rewards), group):
        values = torch.tensor(rewards[start : start + group])
        out += ((values - values.mean()) / (values.std() + 1e-4)).tolist()
    return out


def grpo_step(model: Any, args: argparse.Namespace, rng: random.Random, step: int) -> dict[str, Any]:
    """One rollout and its ``--mini-batches`` updates; the step's record."""
    tasks = [task(rng, args.prompt_letters) for _ in range(args.prompts)]
    prompts = [prompt for prompt, _ in tasks for _ in range(args.group_size)]
    answers = [answer for _, answer in tasks for _ in range(args.group_size)]
    sample = {"do_sample": True, "temperature": args.temperature, "seed": args.seed * 100_003 + step}
    rows, routes = model.generate(prompts, len(answers[0]), eos_token_ids=[EOS], return_routed_experts=True, **sample)
    prompt_len = len(prompts[0])
    rewards = [reward(row[prompt_len:], answer) for row, answer in zip(rows, answers, strict=True)]
    advantages = group_advantages(rewards, args.group_size)
    batch = rollout_batch(rows, prompt_len, None if args.no_replay else routes, advantages)
    ids, mask, routed = batch["input_ids"], batch["attention_mask"], batch["routes"]
    old = model.logprobs(ids, mask, temperature=args.temperature, routed_experts=routed)
    order = torch.randperm(ids.shape[0], generator=torch.Generator().manual_seed(step))
    metrics: list[dict[str, Any]] = []
    for part in torch.tensor_split(order, args.mini_batches):
        metrics.append(
            model.train_step(
                ids[part],
                attention_mask=mask[part],
                loss="ppo",
                advantages=batch["advantages"][part],  # type: ignore[index]
                old_logprobs=old[part],
                loss_mask=batch["loss_mask"][part],  # type: ignore[index]
                routed_experts=routed[part] if routed is not None else None,
                clip_low=args.clip_low,
                clip_high=args.clip_high,
                temperature=args.temperature,
            )
        )
    keys = ("loss", "clip_fraction", "approx_kl", "grad_norm")
    record = {"step": step, "reward_mean": sum(rewards) / len(rewards), "solved": sum(r == 1.0 for r in rewards)}
    record.update({key: sum(m[key] for m in metrics) / len(metrics) for key in keys})
    record["num_tokens"] = sum(m["num_tokens"] for m in metrics)
    return record


def plot_rewards(records: list[dict[str, Any]], path: Path) -> Path:
    """The reward curve (mean reward per step, and its 10-step running mean) and the clip fraction, as one PNG."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(10, 3.6), layout="constrained")
    FigureCanvasAgg(figure)
    reward_ax, clip_ax = figure.subplots(1, 2)
    steps = [r["step"] for r in records]
    rewards = [r["reward_mean"] for r in records]
    running = [sum(rewards[max(0, i - 9) : i + 1]) / len(rewards[max(0, i - 9) : i + 1]) for i in range(len(rewards))]
    reward_ax.plot(steps, rewards, alpha=0.4, label="mean reward")
    reward_ax.plot(steps, running, label="10-step mean")
    clip_ax.plot(steps, [r["clip_fraction"] for r in records], label="clip fraction")
    clip_ax.plot(steps, [r["approx_kl"] for r in records], label="approx KL (old || new)")
    for ax, title in ((reward_ax, "reward"), (clip_ax, "PPO")):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend()
    figure.savefig(path, dpi=100)
    return path


def run(args: argparse.Namespace, world: RankGroup | None = None) -> list[dict[str, Any]]:
    """The whole run; returns the step records (also in ``--output-dir/metrics.jsonl``). ``world``: ranks already
    started (``raymoe.start_world``) to load onto instead of starting this run's own; its size is the layout's,
    --cpus-per-rank is then its own, and it stays up after the run (the model is unloaded)."""
    layout = parse_layout(args.layout)
    raymoe.DistributedConfig(**layout)  # a bad layout fails here, before anything starts
    source = args.model or str(raymoe.build_tiny_checkpoint(args.output_dir / "base-model", seed=args.seed))
    rng = random.Random(args.seed)
    started = time.perf_counter()
    placement = {"cpus_per_rank": args.cpus_per_rank} if world is None else {"world": world}
    with raymoe.from_pretrained(source, distributed_config=layout, **placement) as model:
        log = MetricsLog(args.output_dir / METRICS_FILE)  # once the model loaded: a refused layout writes nothing
        model.configure_training(lr=args.lr, weight_decay=0.0, balance="none")
        with tqdm(total=args.steps, desc="grpo", unit="step", disable=args.no_progress, mininterval=0.5) as bar:
            for step in range(1, args.steps + 1):
                record = grpo_step(model, args, rng, step)
                record["elapsed_s"] = time.perf_counter() - started
                log.append(record)
                bar.set_postfix(reward=f"{record['reward_mean']:.3f}", clip=f"{record['clip_fraction']:.3f}")
                bar.update()
        model.save_pretrained(args.output_dir / "checkpoint")
    plot_rewards(log.records, args.output_dir / "metrics.png")
    first, last = log.records[:10], log.records[-10:]
    mean = lambda part: sum(r["reward_mean"] for r in part) / len(part)  # noqa: E731
    print(
        f"reward: first {len(first)} steps {mean(first):.3f}, last {len(last)} steps {mean(last):.3f} "
        f"({'no replay' if args.no_replay else 'router replay'}); {time.perf_counter() - started:.0f} s; "
        f"{args.output_dir / METRICS_FILE}"
    )
    return log.records


def main(argv: list[str] | None = None, world: RankGroup | None = None) -> int:
    """The command line; ``world`` as in :func:`run`."""
    args = parse_args(argv)
    try:
        run(args, world)
    except (ValueError, PlacementError) as exc:
        print(f"grpo.py: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
