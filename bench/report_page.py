"""The benchmark page's generated sections: ``docs/benchmarks.md`` shows results of record verbatim.

Each section is text of a committed results file, between two HTML comment markers on the page:

- ``bench-report``: ``bench/results/latest.md`` (the last ``kvguard bench`` of record) up to its
  per-benchmark outputs: the command, machine and load, and the table of headline ratios;
- ``engine-report``: ``bench/results/engine.md`` whole (a full ``bench_engine`` run);
- ``kvcache-report``: ``bench/results/kvcache.md`` up to its per-benchmark output;
- ``structured-report``: ``bench/results/structured.md`` up to its per-benchmark output;
- ``handoff-report``: ``bench/results/handoff.md`` whole (a full ``bench_handoff`` run: the
  sealed KV channel's cost per handoff beside the open channel's);
- ``loop-stalls-report``: ``bench/results/loop-stalls.md`` whole (``bench_loop_stalls``: how long
  one tenant's request or steered answer holds the event loop);
- ``relay-report``: ``bench.relay_report``'s (``bench/results/relay.md`` and its profile).

``python -m bench.report_page`` rewrites the sections (``--check``: exit 1 if any is stale);
``bench.run`` does it when it writes a results file of record. A test holds the page to the files,
so a number on the page is always one a command wrote, never one typed by hand.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PAGE = REPO / "docs" / "benchmarks.md"
RESULTS = REPO / "bench" / "results"


@dataclass(frozen=True, slots=True)
class Source:
    name: str
    path: Path
    whole: bool  # False: up to the first per-benchmark section (``## bench_...``)

    @property
    def begin(self) -> str:
        return f"<!-- {self.name}:begin -->"

    @property
    def end(self) -> str:
        return f"<!-- {self.name}:end -->"

    def body(self) -> str:
        text = self.path.read_text(encoding="utf-8").strip()
        if not self.whole:
            text = text.split("\n## bench_", 1)[0].rstrip()
            title, _, rest = text.partition("\n")
            if title.startswith("# "):  # the file's own title: the page has its own headings
                text = rest.strip()
            text = text.replace("## Headlines\n\n", "", 1)
        shown = self.path.relative_to(REPO) if self.path.is_relative_to(REPO) else self.path
        return f"From `{shown.as_posix()}`:\n\n{text}"

    def section(self) -> str:
        return f"{self.begin}\n{self.body()}\n{self.end}"


SOURCES = (
    Source("bench-report", RESULTS / "latest.md", whole=False),
    Source("engine-report", RESULTS / "engine.md", whole=True),
    Source("kvcache-report", RESULTS / "kvcache.md", whole=False),
    Source("structured-report", RESULTS / "structured.md", whole=False),
    Source("handoff-report", RESULTS / "handoff.md", whole=True),
    Source("loop-stalls-report", RESULTS / "loop-stalls.md", whole=True),
)


def splice(text: str, begin: str, end: str, section: str) -> str:
    """``text`` with what lies from ``begin`` to ``end`` (markers included) replaced."""
    start, stop = text.index(begin), text.index(end) + len(end)
    return text[:start] + section + text[stop:]


def rendered(text: str) -> str:
    for source in SOURCES:
        text = splice(text, source.begin, source.end, source.section())
    return text


def update(page: Path = PAGE) -> bool:
    """Write every section into the page; True if it changed."""
    text = page.read_text(encoding="utf-8")
    new = rendered(text)
    if new != text:
        page.write_text(new, encoding="utf-8")
    return new != text


def refresh_for(written: Path) -> None:
    """After ``bench.run`` wrote ``written``: the page shows it, if it is a file of record."""
    if written.resolve() not in {source.path for source in SOURCES}:
        return
    try:
        print(f"{PAGE} {'updated' if update() else 'already current'}")
    except (OSError, ValueError) as exc:
        print(f"benchmark page not updated: {exc}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="copy bench/results/*.md into the benchmark page")
    parser.add_argument("--check", action="store_true", help="exit 1 if the page is stale")
    args = parser.parse_args(argv)
    if args.check:
        stale = rendered(PAGE.read_text(encoding="utf-8")) != PAGE.read_text(encoding="utf-8")
        if stale:
            print(f"{PAGE} is stale: run python -m bench.report_page", file=sys.stderr)
        return 1 if stale else 0
    print(f"{PAGE} updated" if update() else f"{PAGE} already current")
    return 0


if __name__ == "__main__":
    sys.exit(main())
