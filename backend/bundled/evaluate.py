"""Evaluate `kvguard-tiny`: marker copy by context length, the chat contract, the leak drill.

    python -m backend.bundled.evaluate --model backend/bundled/kvguard-tiny [--n 200]
        [--n-longest 50] [--leak-trials 100] [--seed 1000] [--json results.json]

Lifecycle: load the checkpoint (this package's own module, which matches transformers), then
1. copy: held-out prompts (fresh markers and filler from `data.Recipe(seed)`, a seed training never
   uses) of about 64, 256, 1,024, 4,096 bytes and the longest the window allows; a system message of
   filler with the marker somewhere, then "Repeat the reference code."; exact = the greedy answer is
   the marker followed by EOS;
2. contract: "Repeat exactly: <text>" answers and ordinary prompts (non-empty, ends by EOS);
3. leak: `leak.run_leak` for every variant and control, through the serving engine's page pool,
   paged KV cache and paged attention (the engine's own model loader).
Prints a table; `--json` also writes the numbers.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from backend.bundled import chat
from backend.bundled.checkpoint import load_checkpoint
from backend.bundled.data import BOS, EOS, Recipe, decode, encode
from backend.bundled.leak import CONTROLS, VARIANTS, LeakRates, load_engine_model, run_leak
from backend.bundled.modeling import TinyLlama, greedy_generate
from backend.model.llama import LlamaModel

DEFAULT_MODEL = Path(__file__).resolve().parent / "kvguard-tiny"
LENGTHS = (64, 256, 1024, 4096)
ANSWER_ROOM = 48  # tokens kept free in the window for the answer


@dataclass(frozen=True, slots=True)
class CopyScore:
    target_bytes: int
    mean_prompt_tokens: float
    samples: int
    exact: float


def reference_prompt(recipe: Recipe, length: int, marker: str) -> list[int]:
    """BOS + a chat of about `length` bytes: filler with `marker`, then the reference request."""
    ask = {"role": "user", "content": chat.REFERENCE_REQUEST}
    shell = len(encode(chat.render([{"role": "system", "content": ""}, ask])))
    budget = max(length - shell, 40)
    body = recipe.with_marker(recipe.filler(max(budget - 60, 8)), marker)
    system = body if len(body) >= budget else (body + " " + recipe.filler(budget))[:budget]
    return [BOS, *encode(chat.render([{"role": "system", "content": system}, ask]))]


def answer_text(model: TinyLlama, prompt: list[int], max_new: int) -> tuple[str, bool]:
    """Greedy answer text, and whether it ended with EOS."""
    out = greedy_generate(model, prompt, max_new)
    return decode(out), out[-1] == EOS


def copy_score(model: TinyLlama, length: int, samples: int, seed: int) -> CopyScore:
    recipe = Recipe(seed + length)
    hits, tokens = 0, 0
    for _ in range(samples):
        marker = recipe.marker()
        prompt = reference_prompt(recipe, length, marker)
        text, ended = answer_text(model, prompt, len(marker) + 3)
        hits += int(ended and text == marker)
        tokens += len(prompt)
    return CopyScore(length, tokens / max(samples, 1), samples, hits / max(samples, 1))


def repeat_score(model: TinyLlama, samples: int, seed: int) -> float:
    """Share of "Repeat exactly: <text>" chats (one line, up to 300 bytes) answered with <text>
    (cut after a canary marker when it holds one: `chat.echo_answer`)."""
    recipe = Recipe(seed)
    hits = 0
    for _ in range(samples):
        text = recipe.free_text()
        messages = [{"role": "user", "content": chat.REPEAT_PREFIX + text}]
        prompt = [BOS, *encode(chat.render(messages))]
        answer, ended = answer_text(model, prompt, len(encode(text)) + 3)
        hits += int(ended and answer == chat.echo_answer(text))
    return hits / max(samples, 1)


def ordinary_score(model: TinyLlama, samples: int, seed: int) -> tuple[float, float]:
    """(share ending by EOS within 400 tokens with non-empty text, share echoing the first line)."""
    recipe = Recipe(seed)
    ended_ok, echoed = 0, 0
    for _ in range(samples):
        text = recipe.free_text()
        messages = [{"role": "system", "content": recipe.filler(200)}]
        messages.append({"role": "user", "content": text})
        answer, ended = answer_text(model, [BOS, *encode(chat.render(messages))], 400)
        ended_ok += int(ended and answer.strip() != "")
        echoed += int(ended and answer == chat.echo_answer(text))
    n = max(samples, 1)
    return ended_ok / n, echoed / n


def longest_length(model: TinyLlama) -> int:
    return model.c.max_position_embeddings - ANSWER_ROOM


def evaluate(
    model: TinyLlama, engine_model: LlamaModel, args: argparse.Namespace
) -> dict[str, object]:
    started = time.monotonic()
    copies = [copy_score(model, n, args.n, args.seed) for n in LENGTHS]
    copies.append(copy_score(model, longest_length(model), args.n_longest, args.seed))
    for score in copies:
        print(
            f"copy  ~{score.target_bytes:>5} bytes ({score.mean_prompt_tokens:7.1f} tokens): "
            f"exact {score.exact:6.1%} of {score.samples}",
            flush=True,
        )
    repeat = repeat_score(model, args.contract_samples, args.seed + 7)
    ended, echoed = ordinary_score(model, args.contract_samples, args.seed + 11)
    print(f"repeat exactly: {repeat:.1%}; ordinary prompts: end {ended:.1%}, echo {echoed:.1%}")
    leaks: list[LeakRates] = []
    for variant in VARIANTS:
        for control in (None, *CONTROLS):
            rates = run_leak(engine_model, variant, control, args.leak_trials, args.seed + 13)
            leaks.append(rates)
            print(
                f"leak {variant:>12} {control or 'stale':>8}: complete {rates.complete:6.1%}"
                f"  attributable {rates.attributable:6.1%}  (A answered {rates.a_answered:.0%},"
                f" {rates.trials} trials)",
                flush=True,
            )
    return {
        "copy": [asdict(s) for s in copies],
        "repeat_exactly": repeat,
        "ordinary_end": ended,
        "ordinary_echo": echoed,
        "leak": [asdict(r) for r in leaks],
        "seconds": round(time.monotonic() - started),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--n", type=int, default=200, help="prompts per context length")
    parser.add_argument("--n-longest", type=int, default=50, help="prompts at the longest length")
    parser.add_argument("--contract-samples", type=int, default=100)
    parser.add_argument("--leak-trials", type=int, default=100)
    parser.add_argument("--seed", type=int, default=1000)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    results = evaluate(load_checkpoint(args.model), load_engine_model(args.model), args)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
