"""bench.run: the report runs the named benchmarks as processes and records what it ran on."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import run


def test_one_benchmark_report_names_commit_command_machine_and_headline(tmp_path: Path) -> None:
    out = tmp_path / "report.md"
    assert run.main(["--only", "bench_core_verify", "--out", str(out)]) == 0
    report = out.read_text()
    head = report.split("## Headlines", 1)[0]
    assert "`python -m bench.run --only bench_core_verify --out " in head
    assert f"at commit {run.commit()}" in head
    assert "CPUs (" in head and "torch " in head and "Load average" in head
    # the benchmark's own headline reached the one table
    assert "| ownership | pool.verify cost per page" in report
    assert "## bench_core_verify (`python -m bench.bench_core_verify`, ok," in report


def test_an_unknown_benchmark_is_refused_by_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        run.main(["--only", "bench_nope", "--out", str(tmp_path / "r.md")])
    assert exc.value.code == 2
    assert "no such benchmark: bench_nope" in capsys.readouterr().err
    assert not (tmp_path / "r.md").exists()


def test_gateway_runs_twice_and_quick_passes_through_where_offered() -> None:
    assert run.runs("bench_gateway", quick=False) == [["--skip-litellm"], ["--firewall-cpu"]]
    assert ["--firewall-cpu"] in run.runs("bench_gateway", quick=True)
    assert run.runs("bench_engine", quick=True) == [["--quick"]]
    assert run.runs("bench_scanner", quick=True) == [[]]
