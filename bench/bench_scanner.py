"""Benchmark of the canary stream scanner against a pass-through loop.

Run: ``python bench/bench_scanner.py`` (``--help`` for options). Prints one table row per
workload and chunk size: scanner throughput (characters/s), per-chunk latency of ``feed`` (p50,
p99, max in microseconds), the same for a pass-through loop over the same chunks in the same
run, and the throughput ratio. The goal is a p99 under 100 us per chunk.

Workloads:
- ``text``: ordinary prose with capitalised words (``C...`` makes the scanner hold back a
  character now and then), one own marker per ~2,000-character response, echoed by the model.
- ``adversarial``: a response made only of well-formed look-alikes (every 37 characters a
  MAC to check) and marker prefixes: the most work a response can cost per character.
- ``folded``: the same against folded reading -- bent prefixes (``cnry|``, spaced) before
  bodies nobody has, and the tags of indexed tenants (1,000 of them) with their key id after
  them in ordinary words: every window a candidate, most of them held and checked to 32
  characters.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from bench.summary import emit
from canary.candidates import FixedTags, LiveTags
from canary.markers import KnownTag, MarkerCodec, MarkerKeyring, encode_tag
from canary.scanner import StreamScanner

OWNER = "tn_00001"

GOAL_P99_US = 100.0
B32 = "ABCDEFGHIJKLMNOPQRSTUVWXYZ234567"
WORDS = [
    "the",
    "a",
    "of",
    "and",
    "to",
    "in",
    "is",
    "was",
    "Cache",
    "Context",
    "Node",
    "Request",
    "Canary",
    "page",
    "decode",
    "prefill",
    "tenant",
    "model",
    "token",
    "window",
    "pool",
    "CNRX",
    "Cn",
    "CN",
    "CNR",
    "copy",
    "answer",
    "because",
    "of",
    "which",
    "then",
    "value",
    "key",
    "data",
]


@dataclass(frozen=True, slots=True)
class Row:
    workload: str
    chunk: int
    chars_per_s: float
    p50_us: float
    p99_us: float
    max_us: float
    base_chars_per_s: float
    base_p50_us: float
    base_p99_us: float


def make_codec() -> MarkerCodec:
    keyring = MarkerKeyring({1: bytes(range(32)), 2: bytes(range(64, 96))}, current=2)
    return MarkerCodec(keyring)


def prose_responses(rng: random.Random, codec: MarkerCodec, total: int) -> list[tuple[str, bytes]]:
    """Responses of about 2,000 characters, each echoing its own marker once."""
    responses, size = [], 0
    while size < total:
        marker = codec.issue(OWNER)
        words = [rng.choice(WORDS) for _ in range(330)]
        words.insert(rng.randrange(len(words)), marker.text)
        text = " ".join(words)
        responses.append((text, marker.nonce))
        size += len(text)
    return responses


def adversarial_responses(rng: random.Random, total: int) -> list[tuple[str, bytes]]:
    pieces, size = [], 0
    while size < total:
        piece = rng.choice(["CNRY-" + "".join(rng.choices(B32, k=32)), "CNR", "C", "CNRY-AB "])
        pieces.append(piece)
        size += len(piece)
    text = "".join(pieces)
    return [(text[i : i + 2000], bytes(8)) for i in range(0, len(text), 2000)]


def folded_responses(
    rng: random.Random, codec: MarkerCodec, known: dict[str, KnownTag], total: int
) -> list[tuple[str, bytes]]:
    tags = list(known)
    own = encode_tag(codec.tenant_tag(OWNER))
    pieces, size = [], 0
    while size < total:
        body = "".join(rng.choices(B32, k=32))
        piece = rng.choice(
            [
                "cnry|" + body.lower(),  # an anchor before a body nobody has: read to 32
                " ".join("CNRY-" + body),
                own + body[8:],  # the owner's tag, no MAC: held to 32, checked, stripped
                rng.choice(tags) + "77" + body[10:],  # a foreign tag, another key id: ordinary
                rng.choice(WORDS) + " " + rng.choice(tags)[:7],
            ]
        )
        pieces.append(piece + " ")
        size += len(piece) + 1
    text = "".join(pieces)
    return [(text[i : i + 2000], bytes(8)) for i in range(0, len(text), 2000)]


def chunks_of(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


def time_chunks(
    responses: Sequence[tuple[str, bytes]],
    size: int,
    make_feed: Callable[[bytes], tuple[Callable[[str], object], Callable[[], object]]],
) -> tuple[float, list[float]]:
    """Total seconds spent in feed+finish, and each feed's latency in microseconds."""
    latencies: list[float] = []
    total_ns = 0
    clock = time.perf_counter_ns
    for text, nonce in responses:
        feed, finish = make_feed(nonce)
        for chunk in chunks_of(text, size):
            t0 = clock()
            feed(chunk)
            dt = clock() - t0
            latencies.append(dt / 1000)
            total_ns += dt
        t0 = clock()
        finish()
        total_ns += clock() - t0
    return total_ns / 1e9, latencies


def measure(
    workload: str,
    responses: Sequence[tuple[str, bytes]],
    size: int,
    codec: MarkerCodec,
    known: LiveTags,
) -> Row:
    chars = sum(len(text) for text, _ in responses)

    def scanner_feed(nonce: bytes) -> tuple[Callable[[str], object], Callable[[], object]]:
        scanner = StreamScanner(codec, owner_tenant_id=OWNER, own_nonces={nonce}, known_tags=known)
        return scanner.feed, scanner.finish

    def passthrough_feed(nonce: bytes) -> tuple[Callable[[str], object], Callable[[], object]]:
        out: list[str] = []

        def feed(chunk: str) -> str:
            out.append(chunk)
            return chunk

        return feed, out.clear

    base_s, base_lat = time_chunks(responses, size, passthrough_feed)
    scan_s, scan_lat = time_chunks(responses, size, scanner_feed)
    return Row(
        workload=workload,
        chunk=size,
        chars_per_s=chars / scan_s,
        p50_us=statistics.median(scan_lat),
        p99_us=quantile(scan_lat, 0.99),
        max_us=max(scan_lat),
        base_chars_per_s=chars / base_s,
        base_p50_us=statistics.median(base_lat),
        base_p99_us=quantile(base_lat, 0.99),
    )


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def construction_us(codec: MarkerCodec, n: int = 2000) -> float:
    t0 = time.perf_counter_ns()
    for _ in range(n):
        StreamScanner(codec, owner_tenant_id=OWNER, own_nonces={bytes(8)})
    return (time.perf_counter_ns() - t0) / n / 1000


def print_table(rows: Sequence[Row]) -> None:
    head = (
        f"{'workload':<12}{'chunk':>6}{'scan chars/s':>15}{'p50 us':>9}{'p99 us':>9}"
        f"{'max us':>9}{'base chars/s':>15}{'base p50':>10}{'base p99':>10}{'ratio':>8}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r.workload:<12}{r.chunk:>6}{r.chars_per_s:>15,.0f}{r.p50_us:>9.2f}{r.p99_us:>9.2f}"
            f"{r.max_us:>9.1f}{r.base_chars_per_s:>15,.0f}{r.base_p50_us:>10.2f}"
            f"{r.base_p99_us:>10.2f}{r.base_chars_per_s / r.chars_per_s:>7.1f}x"
        )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chars", type=int, default=400_000, help="characters per workload")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--sizes", type=int, nargs="+", default=[4, 8, 16, 32, 64])
    args = parser.parse_args(argv)

    codec = make_codec()
    known = codec.known_tags(f"tn_{i:05d}" for i in range(1000))
    index = FixedTags(known)  # one set and automaton for every scanner, as the firewall's index
    rng = random.Random(args.seed)
    workloads = {
        "text": prose_responses(rng, codec, args.chars),
        "adversarial": adversarial_responses(rng, args.chars),
        "folded": folded_responses(rng, codec, known, args.chars),
    }
    rows = [
        measure(name, responses, size, codec, index)
        for name, responses in workloads.items()
        for size in args.sizes
    ]
    print_table(rows)
    print(f"\nscanner construction (per response): {construction_us(codec):.2f} us")
    worst = max(r.p99_us for r in rows)
    verdict = "PASS" if worst < GOAL_P99_US else "FAIL"
    print(f"worst p99 per chunk: {worst:.2f} us (goal < {GOAL_P99_US:.0f} us): {verdict}")
    emit(
        "scanner",
        "leak scanner p99 per stream chunk (us)",
        f"{worst:.2f} us",
        f"< {GOAL_P99_US:.0f} us",
        worst < GOAL_P99_US,
    )
    slowest = min(rows, key=lambda r: r.chars_per_s)
    emit(
        "scanner",
        f"leak scanner throughput, slowest workload ({slowest.workload}, {slowest.chunk}-char "
        "chunks): chars/s, and pass-through / scanner",
        f"{slowest.chars_per_s / 1e6:.1f} M chars/s; "
        f"{slowest.base_chars_per_s / slowest.chars_per_s:.1f}x",
    )
    print("ratio = pass-through throughput / scanner throughput, same chunks, same run")
    return 0 if worst < GOAL_P99_US else 1


if __name__ == "__main__":
    raise SystemExit(main())
