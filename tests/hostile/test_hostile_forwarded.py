"""Who a client is, for the failed-credential throttles (issue 32, finding 2).

Attacker: a guesser behind no proxy who sends ``X-Forwarded-For`` (or ``Forwarded``, or
``X-Real-IP``) with a new address on every wrong admin token, so the throttle never sees the same
address twice; and a neighbour who sends wrong tokens *in the name of* the operator's address to
lock the operator out. The gateway used to believe those headers from any peer on 127.0.0.1
(uvicorn's default): 300 guesses drew no 429, and 11 wrong tries locked the real admin token out
of a chosen address.

Proves, against the real gateway under uvicorn on 127.0.0.1 (``kvguard gateway``'s server
config): with no proxies listed (the default) forwarded headers change nothing -- the guesser is
throttled after its budget however it names itself, and the address it named keeps its own
budget; with the proxy listed (``KVGUARD_TRUSTED_PROXIES``, as compose lists nginx) the address
the proxy forwards is the client, and a chain the client wrote itself cannot choose it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hostile_harness import ServedGateway, gateway_settings, openai_error, served_gateway

BUDGET = 5
WRONG = {"Authorization": "Bearer not-the-admin-token"}
UNKNOWN_KEY = {"Authorization": "Bearer kvg_" + "a" * 12 + "_" + "b" * 64}
HEADERS = ("X-Forwarded-For", "Forwarded", "X-Real-IP")


def _forwarded(header: str, address: str) -> dict[str, str]:
    return {header: f"for={address}" if header == "Forwarded" else address}


@pytest.fixture
def served(sqlite_url: str, engine: Any, request: pytest.FixtureRequest) -> Iterator[ServedGateway]:
    overrides = dict(getattr(request, "param", {}))
    settings = gateway_settings(
        sqlite_url,
        engine.url,
        operator_failures_per_minute=BUDGET,
        auth_failures_per_minute=BUDGET,
        **overrides,
    )
    with served_gateway(settings) as gw:
        yield gw


def _client(gw: ServedGateway, local: str = "127.0.0.1") -> httpx.Client:
    transport = httpx.HTTPTransport(local_address=local)
    return httpx.Client(base_url=gw.url, transport=transport, timeout=10)


@pytest.mark.parametrize("header", HEADERS)
def test_a_new_forwarded_address_per_guess_does_not_escape_the_throttle(
    served: ServedGateway, header: str
) -> None:
    with _client(served) as client:
        for path, credential in (("/admin/tenants", WRONG), ("/v1/models", UNKNOWN_KEY)):
            statuses = [
                client.get(path, headers={**credential, **_forwarded(header, f"203.0.113.{n}")})
                for n in range(4 * BUDGET)
            ]
            codes = [r.status_code for r in statuses]
            assert codes[:BUDGET] == [401] * BUDGET and set(codes[BUDGET:]) == {429}, codes
            assert openai_error(statuses[-1])["code"] == "too_many_failed_credentials"


def test_failures_in_the_name_of_another_address_do_not_lock_it_out(
    served: ServedGateway,
) -> None:
    with _client(served) as neighbour:
        for _ in range(2 * BUDGET + 1):
            neighbour.get("/admin/tenants", headers={**WRONG, "X-Forwarded-For": "127.0.0.2"})
        assert neighbour.get("/admin/tenants", headers=served.admin).status_code == 429
    with _client(served, "127.0.0.2") as operator:  # the address named: untouched
        assert operator.get("/admin/tenants", headers=served.admin).status_code == 200
        assert operator.get("/metrics", headers=served.admin).status_code == 200


@pytest.mark.parametrize("served", [{"trusted_proxies": ["127.0.0.1"]}], indirect=True)
def test_a_listed_proxy_names_the_client(served: ServedGateway) -> None:
    """127.0.0.1 plays the listed proxy (compose: nginx): the address it forwards is the one
    throttled; another forwarded client keeps its budget; a chain the client started cannot pick
    the address (the nearest one the proxy did not list counts)."""
    with _client(served) as proxy:
        for _ in range(BUDGET):
            r = proxy.get("/admin/tenants", headers={**WRONG, "X-Forwarded-For": "198.51.100.7"})
            assert r.status_code == 401
        guesser = {"X-Forwarded-For": "198.51.100.7"}
        assert proxy.get("/admin/tenants", headers={**WRONG, **guesser}).status_code == 429
        forged = {"X-Forwarded-For": "198.51.100.8, 198.51.100.7"}  # "I am .8", says .7
        assert proxy.get("/admin/tenants", headers={**served.admin, **forged}).status_code == 429
        other = {"X-Real-IP": "198.51.100.8"}
        assert proxy.get("/admin/tenants", headers={**served.admin, **other}).status_code == 200


@pytest.mark.parametrize("served", [{"trusted_proxies": ["127.0.0.1"]}], indirect=True)
def test_the_completion_door_throttles_the_client_a_listed_proxy_names(
    served: ServedGateway,
) -> None:
    """The completion routes run below FastAPI (``gateway.proxy.door``) and verify keys through the
    same ``principal_of``: their failed-key budget is the client's as the listed proxy names it
    (one client throttled, another forwarded client untouched), never the proxy's own."""
    chat = {"model": "any", "messages": [{"role": "user", "content": "hi"}]}
    with _client(served) as proxy:

        def post(address: str) -> httpx.Response:
            headers = {**UNKNOWN_KEY, "X-Forwarded-For": address}
            return proxy.post("/v1/chat/completions", headers=headers, json=chat)

        codes = [post("198.51.100.9").status_code for _ in range(2 * BUDGET)]
        assert codes[:BUDGET] == [401] * BUDGET and set(codes[BUDGET:]) == {429}, codes
        assert openai_error(post("198.51.100.9"))["code"] == "too_many_failed_credentials"
        assert post("198.51.100.10").status_code == 401  # another client: its own budget
