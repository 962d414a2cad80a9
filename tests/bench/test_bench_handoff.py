"""bench_handoff's primitives tables: both AEADs per page and per batch for both page sizes, and
Mooncake's registration cost per handoff, each measured (positive rates and times)."""

from __future__ import annotations

import re

import pytest

from bench import bench_handoff


def test_the_cipher_table_compares_both_aeads_per_page_and_per_batch(
    capsys: pytest.CaptureFixture[str],
) -> None:
    bench_handoff.ciphers(quick=True)
    rows = [line for line in capsys.readouterr().out.splitlines() if re.search(r"\d pages? ", line)]
    assert len(rows) == 4  # two page sizes x (one page, 16 pages)
    for row in rows:
        aes, chacha = (float(x) for x in row.split()[-2:])
        assert aes > 0 and chacha > 0


def test_the_registration_table_measures_each_size(capsys: pytest.CaptureFixture[str]) -> None:
    bench_handoff.registration(quick=True)
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    sizes = [row for row in rows if row and row[0] in ("4", "32", "128")]
    assert [row[0] for row in sizes] == ["4", "32", "128"]
    assert all(float(row[2]) > 0 and float(row[3]) > 0 for row in sizes)
