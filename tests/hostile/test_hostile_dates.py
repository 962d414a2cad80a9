"""Time filters a tenant (or an admin) controls: every listing's ``since``/``until``.

Attacker: any tenant with a key (and, for the admin listings, a careless admin script) who sends
query strings the schema parses as a datetime but the database layer cannot use: a datetime
without a zone, a bare date, or an instant whose conversion to UTC leaves the years datetime can
hold. Each used to raise inside the route (a 500 that also reset the keep-alive connection).

Proves, over real HTTP against the gateway as ``kvguard gateway`` serves it (canary routes on,
the real engine behind it): each is a 400 with an OpenAI-style body naming the parameter, on the
same keep-alive connection, and a zoned instant still filters.
"""

from __future__ import annotations

import httpx
import pytest
from hostile_harness import ServedGateway, openai_error

BAD_INSTANTS = {
    "naive": "2024-01-01T00:00:00",
    "bare-date": "2024-01-01",
    "before-year-1-in-utc": "0001-01-01T00:00:00+05:00",
    "after-year-9999-in-utc": "9999-12-31T23:59:59-05:00",
}


def _routes(tenant: str) -> list[tuple[str, str, bool]]:
    """(path, parameter, needs the admin token) of every listing with a time filter."""
    return [
        ("/v1/usage", "since", False),
        ("/v1/usage", "until", False),
        ("/v1/canary/findings", "since", False),
        (f"/admin/tenants/{tenant}/usage", "since", True),
        (f"/admin/tenants/{tenant}/usage", "until", True),
        ("/admin/canary/findings", "since", True),
        ("/admin/canary/probe-runs", "since", True),
    ]


@pytest.mark.parametrize("case", sorted(BAD_INSTANTS))
def test_an_unusable_instant_is_a_400_on_every_listing(gateway: ServedGateway, case: str) -> None:
    tenant, key = gateway.create_tenant(f"dates-{case}")
    tenant_auth = {"Authorization": f"Bearer {key}"}
    with httpx.Client(base_url=gateway.url, timeout=10) as client:
        for path, param, admin in _routes(tenant):
            headers = gateway.admin if admin else tenant_auth
            r = client.get(path, params={param: BAD_INSTANTS[case]}, headers=headers)
            assert r.status_code == 400, (path, param, r.status_code, r.text)
            error = openai_error(r)
            assert error["param"] == f"query.{param}", (path, error)
            assert error["code"] == "invalid_request", error
        # The keep-alive connection survived every refusal: one more request on it works.
        assert client.get("/v1/usage", headers=tenant_auth).status_code == 200


def test_a_zoned_instant_filters(gateway: ServedGateway) -> None:
    _, key = gateway.create_tenant("dates-ok")
    auth = {"Authorization": f"Bearer {key}"}
    for value in ("2024-01-01T00:00:00Z", "2024-01-01T05:30:00+05:30", "0001-01-01T00:00:00Z"):
        r = httpx.get(gateway.url + "/v1/usage", params={"since": value}, headers=auth)
        assert r.status_code == 200, r.text
        since = r.json()["since"]
        assert since.startswith(("2024-01-01T00:00:00", "0001-01-01T00:00:00")), since
