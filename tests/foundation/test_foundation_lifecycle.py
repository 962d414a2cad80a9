"""One transition mechanism: every lifecycle of every package refuses moves through
``contracts.lifecycle.check_move`` (directly or through ``Machine``), and no module looks a move
up in a transition table by hand."""

from __future__ import annotations

import ast
import pickle
from pathlib import Path

import pytest

from backend.core.errors import InvalidTransition as EngineInvalidTransition
from backend.core.errors import KvguardError
from backend.core.pages import PAGE_TRANSITIONS, PageState
from backend.core.request import TRANSITIONS, RequestState
from canary.scanner import ScannerStateError
from contracts.lifecycle import InvalidTransition, Machine, check_move
from gateway.lifecycle import InvalidTransition as GatewayInvalidTransition
from gateway.lifecycle import Phase, check_transition

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("contracts", "backend", "gateway", "canary", "kvguard", "migrations", "dashboards")
MECHANISM = "contracts/lifecycle.py"


def test_check_move_allows_table_moves_and_names_refused_ones() -> None:
    check_move(TRANSITIONS, "request", "r1", RequestState.WAITING, RequestState.PREFILLING)
    with pytest.raises(InvalidTransition) as caught:
        check_move(PAGE_TRANSITIONS, "page", "3", PageState.FREE, PageState.QUARANTINED)
    assert str(caught.value) == "page 3: free -> quarantined is not allowed"
    assert caught.value.details() == {
        "code": "invalid_state_transition",
        "subject": "page",
        "from_state": "free",
        "to_state": "quarantined",
    }


def test_a_subject_without_an_id_is_named_alone() -> None:
    with pytest.raises(InvalidTransition) as caught:
        check_transition(Phase.RECEIVED, Phase.STREAMING)
    assert str(caught.value) == "request phase received -> streaming is not allowed"


def test_machine_advances_only_along_its_table() -> None:
    machine = Machine("request", "r1", TRANSITIONS, RequestState.WAITING)
    machine.advance(RequestState.PREFILLING)
    assert machine.can(RequestState.DECODING) and not machine.can(RequestState.WAITING)
    with pytest.raises(InvalidTransition):
        machine.advance(RequestState.REJECTED)
    assert machine.state is RequestState.PREFILLING


def test_every_package_raises_the_one_refusal() -> None:
    """The engine's and the gateway's names are the contract's class; the scanner's is a kind of
    it; it stays an engine error (HTTP 500 body, pickles across the handoff's processes)."""
    assert EngineInvalidTransition is InvalidTransition is GatewayInvalidTransition
    assert issubclass(ScannerStateError, InvalidTransition)
    assert issubclass(InvalidTransition, KvguardError) and InvalidTransition.http_status == 500
    error = InvalidTransition("handoff", "h1", "reserved", "done", "listed twice")
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is InvalidTransition and str(copy) == str(error)


def test_no_module_checks_a_transition_table_by_hand() -> None:
    """``X in TABLE[state]`` outside the mechanism would be a second mechanism."""
    offenders = []
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            relative = path.relative_to(REPO).as_posix()
            if relative == MECHANISM:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if _is_table_lookup(node):
                    offenders.append(f"{relative}:{node.lineno}")
    assert offenders == []


@pytest.mark.parametrize(
    "source",
    [
        "if target not in TRANSITIONS[current]: pass",  # the gateway's request phases, before
        "if target not in TENANT_TRANSITIONS[current]: pass",  # its tenant statuses
        "if new not in TRANSITIONS[self._state]: pass",  # the canary's scanner
        "ok = to in lifecycle.PAGE_TRANSITIONS[state]",
        "ok = to in self.faults.decode_table[state]",
    ],
)
def test_the_check_finds_each_by_hand_form(source: str) -> None:
    assert any(_is_table_lookup(node) for node in ast.walk(ast.parse(source)))


def _is_table_lookup(node: ast.AST) -> bool:
    if not isinstance(node, ast.Compare) or not isinstance(node.ops[0], ast.In | ast.NotIn):
        return False
    right = node.comparators[0]
    if not isinstance(right, ast.Subscript):
        return False
    table = right.value
    name = table.id if isinstance(table, ast.Name) else getattr(table, "attr", "")
    return name.endswith("TRANSITIONS") or name.endswith("_table")
