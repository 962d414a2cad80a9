"""The models table of README.md and docs/models.md is `model_matrix.render()` verbatim, and
every cell is proven."""

from __future__ import annotations

import pytest
from model_matrix import FEATURES, PAGES, REPO, coverage, render, table_in
from tiny_families import FAMILY_NAMES


def test_every_family_has_every_feature_tested():
    cover = coverage()
    missing = [(f, fam) for f in FEATURES for fam in FAMILY_NAMES if fam not in cover[f]]
    assert missing == []


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(REPO)))
def test_the_page_holds_the_generated_table(page):
    assert table_in(page) == render(), (
        f"stale: run `python tests/backend/model/model_matrix.py --write` ({page.name})"
    )
