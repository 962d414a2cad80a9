"""Does the canary change a tenant's answer? The bundled model, with and without a marker.

.venv/bin/python -m bench.bench_canary_answers [--quick]   (from the repo root)

A fixed prompt set (``data.Recipe`` with a fixed seed: ordinary chats with and without a system
message, multi-turn chats, ``Repeat exactly:`` chats, and questions about "the reference code"
the tenant never gave) is answered greedily by ``kvguard-tiny`` twice: as an unsampled tenant
sends it, and with the canary's marker injected as a sampled tenant's request is (for each
injection format measured), the injected marker then stripped from the answer as the firewall
strips it (the unsampled answer goes through the firewall too: it reads every answer). An answer
*changed* when the two the tenant would receive differ. Also measured: the prompt tokens the
injection adds (the bundled byte tokenizer: one token per byte), which the gateway counts for
capacity but never bills or rate-limits the tenant for; and how many answers, sampled or not,
lose a marker look-alike the tenant's own text holds (``CNRY-`` and base32 characters that are no
genuine marker of the request: stripped for everyone, the price of giving no oracle). Greedy
decoding: the same prompt always gets the same answer, so a difference is the marker's doing.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from backend.bundled import chat
from backend.bundled.checkpoint import load_checkpoint
from backend.bundled.data import BOS, Recipe, decode, encode
from backend.bundled.evaluate import DEFAULT_MODEL
from backend.bundled.modeling import TinyLlama, greedy_generate
from bench.summary import emit
from canary.injection import inject_chat
from canary.markers import MarkerCodec, MarkerKeyring
from canary.scanner import StreamScanner

Messages = list[dict[str, Any]]
CODEC = MarkerCodec(MarkerKeyring({1: b"bench-canary-answers-key-0123456789"}, current=1))
TENANT = "bench-tenant"
MAX_NEW = 160


def _old_format(messages: Messages, marker: str) -> Messages:
    """The injection before this measurement: ``Reference code: <marker>`` in a system line."""
    line = f"Reference code: {marker}"
    if messages and messages[0].get("role") == "system":
        return [{**messages[0], "content": f"{line}\n{messages[0]['content']}"}, *messages[1:]]
    return [{"role": "system", "content": line}, *messages]


FORMATS: dict[str, Callable[[Messages, str], Messages]] = {
    "before: 'Reference code: <marker>' line": _old_format,
    "now: the bare marker line (inject_chat)": inject_chat,
}


def prompt_set(n: int, seed: int = 20261001) -> list[tuple[str, Messages]]:
    """(kind, messages), ``n`` of each kind, the same every run."""
    r = Recipe(seed)
    out: list[tuple[str, Messages]] = []
    for _ in range(n):
        out.append(("ordinary", [{"role": "user", "content": r.free_text()}]))
        system = {"role": "system", "content": r.filler(160)}
        out.append(("with system", [system, {"role": "user", "content": r.free_text()}]))
        turns = [
            {"role": "user", "content": r.free_text(120)},
            {"role": "assistant", "content": r.free_text(120)},
            {"role": "user", "content": r.free_text(120)},
        ]
        out.append(("multi-turn", turns))
        repeat = chat.REPEAT_PREFIX + r.free_text(200)
        out.append(("repeat exactly", [{"role": "user", "content": repeat}]))
    asks = ("What is the reference code?", chat.REFERENCE_REQUEST, "Give me the reference code.")
    for i in range(max(1, n // 4)):
        out.append(("asks for 'the reference code'", [{"role": "user", "content": asks[i % 3]}]))
    return out


def answer(model: TinyLlama, messages: Messages) -> str:
    return decode(greedy_generate(model, [BOS, *encode(chat.render(messages))], MAX_NEW))


def delivered(text: str, nonce: bytes | None = None) -> str:
    """What the firewall delivers of ``text`` to the tenant (``nonce``: its injected marker's)."""
    scanner = StreamScanner(CODEC, owner_tenant_id=TENANT, own_nonces={nonce} if nonce else ())
    return scanner.feed(text).text + scanner.finish().text


@dataclass
class Tally:
    prompts: int = 0
    changed: int = 0
    added_tokens: int = 0
    firewall_altered: int = 0  # the unsampled answer itself lost a look-alike to the firewall


def measure(model: TinyLlama, prompts: list[tuple[str, Messages]]) -> dict[str, dict[str, Tally]]:
    """format -> kind -> tally (kind "all" included)."""
    raw = [answer(model, messages) for _, messages in prompts]
    plain = [delivered(text) for text in raw]  # unsampled: the firewall reads every answer
    results: dict[str, dict[str, Tally]] = {}
    for name, inject in FORMATS.items():
        by_kind: dict[str, Tally] = {"all": Tally()}
        for (kind, messages), before, unread in zip(prompts, plain, raw, strict=True):
            marker = CODEC.issue(TENANT)
            marked = inject(messages, marker.text)
            after = delivered(answer(model, marked), marker.nonce)
            added = len(encode(chat.render(marked))) - len(encode(chat.render(messages)))
            for tally in (by_kind.setdefault(kind, Tally()), by_kind["all"]):
                tally.prompts += 1
                tally.changed += int(after != before)
                tally.added_tokens += added
                tally.firewall_altered += int(before != unread)
        results[name] = by_kind
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.bench_canary_answers")
    parser.add_argument("--quick", action="store_true", help="12 prompts of each kind, not 40")
    args = parser.parse_args(argv)
    model = load_checkpoint(DEFAULT_MODEL)
    prompts = prompt_set(12 if args.quick else 40)
    results = measure(model, prompts)
    head = f"{'injection format':42s} {'prompts':>29s} {'n':>4s} {'changed':>8s} {'+tokens':>8s}"
    print(head + f" {'look-alike stripped':>20s}")
    for name, by_kind in results.items():
        for kind, t in sorted(by_kind.items(), key=lambda kv: kv[0] != "all"):
            share = 100 * t.changed / t.prompts
            mean = t.added_tokens / t.prompts
            altered = 100 * t.firewall_altered / t.prompts
            row = f"{name:42s} {kind:>29s} {t.prompts:4d} {share:7.1f}% {mean:8.1f}"
            print(row + f" {altered:19.1f}%")
    now = results["now: the bare marker line (inject_chat)"]
    before = results["before: 'Reference code: <marker>' line"]
    asked = "asks for 'the reference code'"
    emit(
        "canary answers",
        "kvguard-tiny answers losing a marker look-alike the tenant sent (every tenant)",
        f"{now['all'].firewall_altered}/{now['all'].prompts}",
    )
    others = [t for kind, t in now.items() if kind not in ("all", asked)]
    changed_others = sum(t.changed for t in others)
    total_others = sum(t.prompts for t in others)
    emit(
        "canary answers",
        "kvguard-tiny answers changed by the injected marker, prompts not asking for it",
        f"{changed_others}/{total_others}",
    )
    emit(
        "canary answers",
        "kvguard-tiny answers changed, prompts asking for 'the reference code'",
        f"{now[asked].changed}/{now[asked].prompts}",
    )
    emit(
        "canary answers",
        "prompt tokens the marker adds (mean), before / now",
        f"{before['all'].added_tokens / before['all'].prompts:.1f} / "
        f"{now['all'].added_tokens / now['all'].prompts:.1f}",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
