"""Load-run samples and their summary, in the metrics serving people use.

Lifecycle: the Locust worker records one ``Sample`` per request (timings, status, token counts,
check outcome; never the prompt, the answer or a marker) and writes them as JSON lines ->
``kvguard load`` reads them back -> ``summarize`` -> the JSON summary and ``format_summary``'s
table.

Definitions (as in vLLM's and LLMPerf's benchmarks, measured at the client through the gateway):
- TTFT: request start to the first chunk carrying content. The gateway's leak firewall holds back
  up to 36 characters, so this includes the wait for that holdback to fill or the answer to end.
- inter-token latency (ITL): the gaps between successive content chunks, pooled over requests.
- TPOT: (end-to-end - TTFT) / (completion tokens - 1), per request.
- end-to-end latency: request start to the end of the stream, over the 200 answers; the other
  answers' (e.g. the refused over-limit size) is ``error_latency_ms``.
- output tokens/s: per request, completion tokens / end-to-end; for the run, all completion
  tokens / wall time.
- requests/s: finished requests / wall time; goodput: requests/s that were answered 200, passed
  every content check and met the SLOs given (``--slo-ttft-ms``, ``--slo-tpot-ms``).
- content-check failures: own marker missing, a foreign marker, inconsistent usage, a stream
  error event; unexpected statuses are counted apart. Either makes the run fail, and so does a
  request still running when the run stopped (``requests_unfinished``, set by the runner): its
  answer was never checked.

Pure: no Locust, no HTTP.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True, slots=True)
class Sample:
    size: str
    tenant: int
    status: int
    code: str | None
    e2e_ms: float
    ttft_ms: float | None = None
    itl_ms: tuple[float, ...] = ()
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    failure_kinds: tuple[str, ...] = ()
    reasons: tuple[str, ...] = field(default=())

    @property
    def ok(self) -> bool:
        return not self.failure_kinds

    @property
    def content_failed(self) -> bool:
        """The answer failed a content check (not only its status)."""
        return "content" in self.failure_kinds

    @property
    def tpot_ms(self) -> float | None:
        if self.ttft_ms is None or not self.completion_tokens or self.completion_tokens < 2:
            return None
        return (self.e2e_ms - self.ttft_ms) / (self.completion_tokens - 1)

    @property
    def output_tokens_per_s(self) -> float | None:
        if self.status != 200 or not self.completion_tokens or self.e2e_ms <= 0:
            return None
        return self.completion_tokens / (self.e2e_ms / 1000)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Sample:
        data = dict(data)
        for key in ("itl_ms", "failure_kinds", "reasons"):
            data[key] = tuple(data.get(key) or ())
        return cls(**data)


def write_samples(path: Path, samples: Iterable[Sample]) -> None:
    with path.open("w") as out:
        for sample in samples:
            out.write(json.dumps(sample.to_json()) + "\n")


def read_samples(path: Path) -> list[Sample]:
    if not path.exists():
        return []
    return [Sample.from_json(json.loads(line)) for line in path.read_text().splitlines() if line]


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None without values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def distribution(values: Sequence[float]) -> dict[str, float | None]:
    out: dict[str, float | None] = {f"p{q}": _round(percentile(values, q)) for q in PERCENTILES}
    out["mean"] = _round(sum(values) / len(values)) if values else None
    out["count"] = len(values)
    return out


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


@dataclass(frozen=True, slots=True)
class Slo:
    ttft_ms: float | None = None
    tpot_ms: float | None = None

    def met(self, sample: Sample) -> bool:
        if self.ttft_ms is not None and (sample.ttft_ms is None or sample.ttft_ms > self.ttft_ms):
            return False
        tpot = sample.tpot_ms
        return self.tpot_ms is None or tpot is None or tpot <= self.tpot_ms


def latency_metrics(samples: Sequence[Sample]) -> dict[str, Any]:
    """TTFT, ITL, TPOT, end-to-end and per-request output tokens/s over the 200 answers; the
    latency of the other answers (refusals, errors) apart."""
    served = [s for s in samples if s.status == 200]
    return {
        "error_latency_ms": distribution([s.e2e_ms for s in samples if s.status != 200]),
        "ttft_ms": distribution([s.ttft_ms for s in served if s.ttft_ms is not None]),
        "itl_ms": distribution([gap for s in served for gap in s.itl_ms]),
        "tpot_ms": distribution([t for s in served if (t := s.tpot_ms) is not None]),
        "e2e_latency_ms": distribution([s.e2e_ms for s in served]),
        "output_tokens_per_s_per_request": distribution(
            [v for s in served if (v := s.output_tokens_per_s) is not None]
        ),
    }


def summarize(
    samples: Sequence[Sample],
    *,
    wall_s: float,
    slo: Slo | None = None,
    sizes: Sequence[dict[str, Any]] = (),
) -> dict[str, Any]:
    slo = slo or Slo()
    wall = max(wall_s, 1e-9)
    content = [s for s in samples if s.content_failed]
    unexpected = [s for s in samples if "status" in s.failure_kinds]
    good = [s for s in samples if s.ok and s.status == 200 and slo.met(s)]
    completion = sum(s.completion_tokens or 0 for s in samples if s.status == 200)
    reasons = Counter(r for s in samples for r in s.reasons)
    by_size = {}
    for size in sizes:
        mine = [s for s in samples if s.size == size["name"]]
        by_size[size["name"]] = {
            **size,
            "requests": len(mine),
            "statuses": dict(Counter(str(s.status) for s in mine)),
            "failures": sum(1 for s in mine if not s.ok),
            **latency_metrics(mine),
        }
    return {
        "requests": len(samples),
        "wall_s": round(wall_s, 3),
        "requests_per_s": round(len(samples) / wall, 3),
        "goodput_requests_per_s": round(len(good) / wall, 3),
        "good_requests": len(good),
        "output_tokens": completion,
        "output_tokens_per_s": round(completion / wall, 3),
        "content_check_failures": len(content),
        "unexpected_statuses": len(unexpected),
        "failure_reasons": dict(reasons.most_common()),
        "statuses": dict(Counter(str(s.status) for s in samples)),
        "slo": asdict(slo),
        **latency_metrics(samples),
        "by_size": by_size,
    }


def progress_line(samples: Sequence[Sample], *, elapsed_s: float, users: int) -> str:
    """One line of a running load: users, requests and their rate, failures (any check), and
    content-check failures (an answer that did not carry its own marker, or carried another's)."""
    failed = sum(1 for s in samples if not s.ok)
    content = sum(1 for s in samples if s.content_failed)
    rate = len(samples) / max(elapsed_s, 1e-9)
    return (
        f"[{elapsed_s:6.1f} s] users {users}  requests {len(samples)} ({rate:.1f}/s)  "
        f"failures {failed}  content-check failures {content}"
    )


def passed(summary: dict[str, Any]) -> bool:
    return (
        summary["requests"] > 0
        and summary["content_check_failures"] == 0
        and summary["unexpected_statuses"] == 0
        and summary.get("requests_unfinished", 0) == 0
    )


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


def format_summary(summary: dict[str, Any]) -> str:
    lines = [
        f"{'size':<7} {'tokens':>7} {'reqs':>5} {'statuses':<16} {'fail':>4} "
        f"{'TTFT p50/p90/p99 ms':>24} {'ITL p50/p99 ms':>16} {'e2e p50/p99 ms':>18} "
        f"{'tok/s p50':>9}"
    ]
    lines.append("-" * len(lines[0]))
    for name, row in summary["by_size"].items():
        statuses = ",".join(f"{k}x{v}" for k, v in sorted(row["statuses"].items()))
        ttft, itl, e2e = row["ttft_ms"], row["itl_ms"], row["e2e_latency_ms"]
        if not e2e["count"]:
            e2e = row["error_latency_ms"]  # a size that is refused: how fast the refusal came
        lines.append(
            f"{name:<7} {row['total_tokens']:>7} {row['requests']:>5} {statuses:<16} "
            f"{row['failures']:>4} "
            f"{_fmt(ttft['p50']) + '/' + _fmt(ttft['p90']) + '/' + _fmt(ttft['p99']):>24} "
            f"{_fmt(itl['p50']) + '/' + _fmt(itl['p99']):>16} "
            f"{_fmt(e2e['p50']) + '/' + _fmt(e2e['p99']):>18} "
            f"{_fmt(row['output_tokens_per_s_per_request']['p50']):>9}"
        )
    ttft, itl, tpot = summary["ttft_ms"], summary["itl_ms"], summary["tpot_ms"]
    e2e = summary["e2e_latency_ms"]
    lines += [
        "",
        f"requests {summary['requests']} in {summary['wall_s']:.1f} s: "
        f"{summary['requests_per_s']:.2f} req/s, goodput {summary['goodput_requests_per_s']:.2f}"
        f" req/s, output {summary['output_tokens_per_s']:.1f} tok/s",
        "TTFT ms p50/p90/p99: " + "/".join(_fmt(ttft[f"p{q}"]) for q in PERCENTILES),
        "ITL ms p50/p90/p99: " + "/".join(_fmt(itl[f"p{q}"]) for q in PERCENTILES),
        "TPOT ms p50/p90/p99: " + "/".join(_fmt(tpot[f"p{q}"]) for q in PERCENTILES),
        "e2e ms p50/p90/p99: " + "/".join(_fmt(e2e[f"p{q}"]) for q in PERCENTILES),
        f"content-check failures {summary['content_check_failures']}, "
        f"unexpected statuses {summary['unexpected_statuses']}",
    ]
    lines += [f"  {count} x {reason}" for reason, count in summary["failure_reasons"].items()]
    if summary.get("requests_unfinished"):
        unfinished = summary["requests_unfinished"]
        lines.append(f"requests still running at the stop timeout (unchecked): {unfinished}")
    lines.append("PASS" if passed(summary) else "FAIL")
    return "\n".join(lines)
