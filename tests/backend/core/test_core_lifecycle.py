"""One transition mechanism: every backend lifecycle refuses moves through ``check_move``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from backend.core.errors import InvalidTransition
from backend.core.lifecycle import Machine, check_move
from backend.core.pages import PAGE_TRANSITIONS, PageState
from backend.core.request import TRANSITIONS, RequestState

BACKEND = Path(__file__).resolve().parents[3] / "backend"


def test_check_move_allows_table_moves_and_names_refused_ones() -> None:
    check_move(TRANSITIONS, "request", "r1", RequestState.WAITING, RequestState.PREFILLING)
    with pytest.raises(InvalidTransition) as caught:
        check_move(PAGE_TRANSITIONS, "page", "3", PageState.FREE, PageState.QUARANTINED)
    assert str(caught.value) == "page 3: free -> quarantined is not allowed"


def test_machine_advances_only_along_its_table() -> None:
    machine = Machine("request", "r1", TRANSITIONS, RequestState.WAITING)
    machine.advance(RequestState.PREFILLING)
    assert machine.can(RequestState.DECODING) and not machine.can(RequestState.WAITING)
    with pytest.raises(InvalidTransition):
        machine.advance(RequestState.REJECTED)
    assert machine.state is RequestState.PREFILLING


def test_no_backend_module_checks_a_transition_table_by_hand() -> None:
    """``X in TABLE[state]`` outside ``lifecycle.py`` would be a second mechanism."""
    offenders = []
    for path in sorted(BACKEND.rglob("*.py")):
        if path.name == "lifecycle.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if _is_table_lookup(node):
                offenders.append(f"{path.relative_to(BACKEND)}:{node.lineno}")
    assert offenders == []


def _is_table_lookup(node: ast.AST) -> bool:
    if not isinstance(node, ast.Compare) or not isinstance(node.ops[0], ast.In | ast.NotIn):
        return False
    right = node.comparators[0]
    return (
        isinstance(right, ast.Subscript)
        and isinstance(right.value, ast.Name)
        and right.value.id.endswith("TRANSITIONS")
    )
