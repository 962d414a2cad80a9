"""docs/benchmarks.md shows the committed results files verbatim (``bench.report_page``)."""

from __future__ import annotations

from pathlib import Path

from bench import report_page


def test_the_page_holds_every_results_file_of_record() -> None:
    text = report_page.PAGE.read_text(encoding="utf-8")
    for source in report_page.SOURCES:
        assert source.section() in text, f"stale: run python -m bench.report_page ({source.name})"
    assert report_page.main(["--check"]) == 0


def test_a_section_is_the_results_head_and_headline_table(tmp_path: Path) -> None:
    results = tmp_path / "latest.md"
    results.write_text(
        "# kvguard benchmarks\n\n- Command: `x`\n\n## Headlines\n\n| a | b |\n|---|---|\n"
        "| 1 | 2 |\n\n## bench_x (`python -m bench.bench_x`, ok, 1 s)\n\n```\nraw\n```\n"
    )
    source = report_page.Source("bench-report", results, whole=False)
    body = source.body().split("\n\n", 1)[1]  # after the "From `...`:" line
    assert body == "- Command: `x`\n\n| a | b |\n|---|---|\n| 1 | 2 |"
    page = tmp_path / "page.md"
    page.write_text(f"# page\n\n{source.begin}\nold\n{source.end}\n\nafter\n")
    text = report_page.splice(page.read_text(), source.begin, source.end, source.section())
    assert "old" not in text and text.endswith("after\n") and "| 1 | 2 |" in text
