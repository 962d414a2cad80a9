"""bench.summary: headlines printed by a benchmark come back intact and form one table."""

from __future__ import annotations

import contextlib
import io

from bench.summary import Headline, emit, missed, parse, table, without_headlines


def test_emitted_headlines_parse_back_and_leave_the_rest_of_the_output_alone() -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print("a benchmark's own table")
        emit("engine", "tok/s at 32 clients, kvguard / serial", "4.58x", "> 3x", True)
        emit("disagg", "tok/s disaggregated / unified", "0.51x")
    text = out.getvalue()
    assert parse(text) == [
        Headline("engine", "tok/s at 32 clients, kvguard / serial", "4.58x", "> 3x", True),
        Headline("disagg", "tok/s disaggregated / unified", "0.51x", "", None),
    ]
    assert without_headlines(text) == "a benchmark's own table"


def test_table_marks_met_missed_and_ungoaled_rows() -> None:
    rows = [
        Headline("a", "x", "1.0x", "> 2x", False),
        Headline("b", "y", "3.0x", "> 2x", True),
        Headline("c", "z", "9 ms"),
    ]
    lines = table(rows).splitlines()
    assert lines[2] == "| a | x | 1.0x | > 2x | **missed** |"
    assert lines[3] == "| b | y | 3.0x | > 2x | met |"
    assert lines[4] == "| c | z | 9 ms |  |  |"
    assert missed(rows) == [rows[0]]
