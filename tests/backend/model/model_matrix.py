"""The models table of the docs, generated from the tests that prove each cell.

A cell (family x feature) is ✓ only when a test of `make test` is parametrised over that family
for that feature; the table is read from the test functions' own `parametrize` marks, so it
cannot claim a family a test does not run. `python tests/backend/model/model_matrix.py` prints
it; `python tests/backend/model/model_matrix.py --write` puts it between the markers of every page
in PAGES; test_model_matrix.py holds those copies to this output.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
sys.path.insert(0, str(HERE))

from tiny_families import FAMILIES  # noqa: E402

# the pages that carry the table, between these markers
PAGES = [REPO / "README.md", REPO / "docs" / "models.md"]
BEGIN, END = "<!-- model-matrix:begin -->", "<!-- model-matrix:end -->"

# feature -> the tests (file, function) that prove it for each family they are parametrised over
FEATURES: dict[str, list[tuple[str, str]]] = {
    "loads": [("test_model_families.py", "test_loads")],
    "logits": [("test_model_families.py", "test_prompt_logits")],
    "greedy": [
        ("test_model_families.py", "test_greedy_tokens"),
        ("test_model_families_http.py", "test_greedy"),
    ],
    "batched": [("test_model_families_http.py", "test_batched")],
    "tokenizer": [("test_model_families_http.py", "test_tokenize")],
    "template": [("test_model_families_http.py", "test_chat_template")],
    "streaming text": [
        ("test_model_families_http.py", "test_streaming_text"),
        ("test_model_families_http.py", "test_first_token_keeps_its_leading_space"),
        ("test_model_families_http.py", "test_byte_fallback_stream_ends_honestly"),
        ("test_model_detokenizer.py", "test_encoded_text_cut_anywhere_streams_honestly"),
        ("test_model_detokenizer.py", "test_random_ids_never_raise_and_stream_honestly"),
    ],
    "json schema": [("test_model_families_http.py", "test_json_schema")],
    "tool calls": [
        ("test_model_families_http.py", "test_tools_template"),
        ("test_model_families_http.py", "test_required_tool_call"),
    ],
}
_MODULES: dict[str, ModuleType] = {}


def _module(file: str) -> ModuleType:
    if file not in _MODULES:
        spec = importlib.util.spec_from_file_location(f"_matrix_{Path(file).stem}", HERE / file)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _MODULES[file] = module
    return _MODULES[file]


def families_of(file: str, function: str) -> list[str]:
    """The families a test function is parametrised over (its `family`/`name` parametrize)."""
    test = getattr(_module(file), function)
    for mark in getattr(test, "pytestmark", []):
        if mark.name == "parametrize" and mark.args[0] in ("family", "name"):
            return list(mark.args[1])
    raise ValueError(f"{file}::{function} is not parametrised over families")


def coverage() -> dict[str, dict[str, list[str]]]:
    """feature -> family -> the test ids that prove the cell."""
    out: dict[str, dict[str, list[str]]] = {}
    for feature, tests in FEATURES.items():
        cells: dict[str, list[str]] = {}
        for file, function in tests:
            for family in families_of(file, function):
                cells.setdefault(family, []).append(f"{file}::{function}[{family}]")
        out[feature] = cells
    return out


def render() -> str:
    cover = coverage()
    head = ["Family (tiny checkpoint)", *FEATURES]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for family in FAMILIES.values():
        cells = ["✓" if family.name in cover[f] else "—" for f in FEATURES]
        summary = family.summary.replace("|", "\\|")  # a bare | would end the cell
        rows.append(f"| **{family.title}**: {summary} | " + " | ".join(cells) + " |")
    legend = ["", "Each ✓ is these tests (in `tests/backend/model/`, `[family]` the row's):", ""]
    for feature, tests in FEATURES.items():
        names = ", ".join(f"`{file}::{function}`" for file, function in tests)
        legend.append(f"- {feature}: {names}")
    return "\n".join(rows + legend)


def _span(text: str) -> tuple[int, int]:
    """Where the table lies in a page: between the end of BEGIN and the start of END."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"no {BEGIN} ... {END} in the page")
    return start + len(BEGIN), end


def table_in(page: Path) -> str:
    """The table a page carries now."""
    text = page.read_text(encoding="utf-8")
    start, end = _span(text)
    return text[start:end].strip("\n")


def write(page: Path) -> None:
    text = page.read_text(encoding="utf-8")
    start, end = _span(text)
    page.write_text(text[:start] + "\n" + render() + "\n" + text[end:], encoding="utf-8")


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        for page in PAGES:
            write(page)
    else:
        print(render())
