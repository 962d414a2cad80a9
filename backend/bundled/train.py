"""Build and train `kvguard-tiny`, then export it in the Hugging Face layout.

    python -m backend.bundled.train --out backend/bundled/kvguard-tiny [--steps N] [--minutes M]
                                    [--seed S] [--threads T]

Lifecycle: 1. `circuit.build_model(seed)` sets the copy circuit by hand; 2. `--steps` optimizer
steps on batches drawn from `data.Recipe(seed)` (mixed lengths, a fixed token budget per step),
with gradients multiplied by `circuit.trainable_masks` so the circuit stays exactly as built;
3. the weights, `config.json` and `training.json` (what ran, how long) are written to `--out`.
Everything is seeded: the same seed and step count give the same weights on the same torch build.
`--minutes` is only a safety cap (the run stops early, and says so, if it is exceeded).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from backend.bundled.checkpoint import save_checkpoint
from backend.bundled.circuit import build_model, positional_shortcut, trainable_masks
from backend.bundled.data import MIX, PAD, Example, Recipe
from backend.bundled.modeling import TinyLlama

# (shortest, longest) context bytes of a batch, and how often such a batch is drawn
LENGTH_BUCKETS = (
    ((48, 256), 0.28),
    ((256, 768), 0.28),
    ((768, 1600), 0.22),
    ((1600, 3200), 0.14),
    ((3200, 4400), 0.08),
)
TOKENS_PER_STEP = 12_000
LEARNING_RATE = 2e-3
WARMUP_STEPS = 30
LOG_EVERY = 10


@dataclass(frozen=True, slots=True)
class Batch:
    ids: torch.Tensor  # [B, T] inputs
    positions: torch.Tensor  # [B, T] their RoPE positions
    targets: torch.Tensor  # [B, T] next tokens (PAD where nothing is predicted)
    weights: torch.Tensor  # [B, T]


def collate(examples: list[Example]) -> Batch:
    width = max(len(e.ids) for e in examples) - 1
    ids = torch.full((len(examples), width), PAD)
    targets = torch.full((len(examples), width), PAD)
    weights = torch.zeros(len(examples), width)
    positions = torch.arange(width).repeat(len(examples), 1)
    for row, e in enumerate(examples):
        n = len(e.ids) - 1
        ids[row, :n] = torch.tensor(e.ids[:-1])
        targets[row, :n] = torch.tensor(e.ids[1:])
        weights[row, :n] = torch.tensor(e.weights)
        if e.positions is not None:  # padding continues after the last real position
            last = e.positions[n - 1]
            positions[row] = torch.tensor(
                e.positions[:n] + list(range(last + 1, last + 1 + width - n))
            )
    return Batch(ids, positions, targets, weights)


def draw_batch(recipe: Recipe) -> Batch:
    r = recipe.rng
    ((low, high),) = r.choices([b for b, _ in LENGTH_BUCKETS], [w for _, w in LENGTH_BUCKETS])
    count = max(1, TOKENS_PER_STEP // high)
    kinds = r.choices(list(MIX), list(MIX.values()), k=count)
    return collate([recipe.example(kind, r.randint(low, high)) for kind in kinds])


def loss_of(model: TinyLlama, batch: Batch) -> tuple[torch.Tensor, float, float]:
    """Weighted cross-entropy, plus the answer-token loss and accuracy (weight-1 targets)."""
    logits = model(batch.ids, batch.positions)
    ce = F.cross_entropy(logits.flatten(0, 1), batch.targets.flatten(), reduction="none")
    w = batch.weights.flatten()
    loss = (ce * w).sum() / w.sum()
    answer = w == 1.0
    correct = logits.flatten(0, 1).argmax(-1) == batch.targets.flatten()
    n = max(int(answer.sum()), 1)
    return loss, float(ce.detach()[answer].sum()) / n, float(correct[answer].sum()) / n


def learning_rate(step: int, total: int) -> float:
    if step < WARMUP_STEPS:
        return LEARNING_RATE * (step + 1) / WARMUP_STEPS
    progress = (step - WARMUP_STEPS) / max(total - WARMUP_STEPS, 1)
    return LEARNING_RATE * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train(model: TinyLlama, recipe: Recipe, steps: int, deadline: float) -> dict[str, object]:
    masks = trainable_masks(model)
    params = [p for _, p in model.named_parameters()]
    opt = torch.optim.AdamW(params, lr=LEARNING_RATE, betas=(0.9, 0.98), weight_decay=0.0)
    start, done, window = time.monotonic(), 0, [0.0, 0.0, 0]
    last: dict[str, float] = {}
    for step in range(steps):
        if time.monotonic() > deadline:
            print(f"stopping at step {step}: --minutes cap reached", flush=True)
            break
        for group in opt.param_groups:
            group["lr"] = learning_rate(step, steps)
        loss, answer_loss, answer_acc = loss_of(model, draw_batch(recipe))
        opt.zero_grad(set_to_none=False)
        loss.backward()
        for name, p in model.named_parameters():
            if p.grad is not None:  # frozen layers get none at all
                p.grad.mul_(masks[name])
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        done = step + 1
        window = [window[0] + answer_loss, window[1] + answer_acc, window[2] + 1]
        if done % LOG_EVERY == 0 or done == steps:
            n = window[2]
            loss_avg, acc_avg = window[0] / n, window[1] / n
            print(
                f"step {done}/{steps} answer_loss {loss_avg:.4f} answer_acc {acc_avg:.4f}"
                f" elapsed {time.monotonic() - start:.0f}s",
                flush=True,
            )
            last = {"answer_loss": window[0] / n, "answer_acc": window[1] / n}
            window = [0.0, 0.0, 0]
    return {"steps_done": done, "seconds": round(time.monotonic() - start), **last}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=700)  # the shipped weights
    parser.add_argument("--minutes", type=float, default=90.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    started = time.monotonic()
    model = build_model(args.seed)
    model.frozen_layers = 1  # layer 0 is all circuit: no gradients to compute there
    model.layer0_attention = positional_shortcut(model)
    model.train()
    summary = train(model, Recipe(args.seed), args.steps, started + 60 * args.minutes)
    model.frozen_layers, model.layer0_attention = 0, None
    model.eval()
    save_checkpoint(model, args.out)
    info = {
        "command": f"python -m backend.bundled.train --out {args.out} --steps {args.steps} "
        f"--seed {args.seed} --threads {args.threads}",
        "seed": args.seed,
        "steps_planned": args.steps,
        "tokens_per_step": TOKENS_PER_STEP,
        "wall_seconds_total": round(time.monotonic() - started),
        "torch": torch.__version__,
        "hardware": f"{platform.machine()} {platform.processor() or ''}".strip()
        + f", {os.cpu_count()} CPUs, {args.threads} torch threads",
        **summary,
    }
    (args.out / "training.json").write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(info), flush=True)


if __name__ == "__main__":
    main()
