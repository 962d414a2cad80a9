"""The models table in the docs is `model_matrix.render()` verbatim, and every cell is proven."""

from __future__ import annotations

from model_matrix import FEATURES, REPO, coverage, render
from tiny_families import FAMILY_NAMES


def docs_page():
    return REPO / "docs" / "models.md"


def test_every_family_has_every_feature_tested():
    cover = coverage()
    missing = [(f, fam) for f in FEATURES for fam in FAMILY_NAMES if fam not in cover[f]]
    assert missing == []


def test_the_docs_hold_the_generated_table():
    page = docs_page()
    assert render() in page.read_text(encoding="utf-8"), (
        f"stale: paste `python tests/backend/model/model_matrix.py` into {page.name}"
    )
