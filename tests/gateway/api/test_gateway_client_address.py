"""``gateway.deps.client_address``: the one place that says who sent a request. Forwarded headers
are believed only from the proxies the operator lists (``KVGUARD_TRUSTED_PROXIES``), and then the
client is the nearest forwarded address that is not itself a listed proxy."""

from __future__ import annotations

import pytest
from starlette.requests import Request

from gateway.config import GatewaySettings
from gateway.deps import client_address, forwarded_chain


def request(peer: str, headers: dict[str, str] | list[tuple[str, str]]) -> Request:
    items = headers.items() if isinstance(headers, dict) else headers
    raw = [(k.lower().encode(), v.encode()) for k, v in items]
    return Request({"type": "http", "client": (peer, 40000), "headers": raw})


DEFAULT = GatewaySettings()
NGINX = GatewaySettings(trusted_proxies=["10.0.0.5", "fd00::/64"])


@pytest.mark.parametrize(
    "headers",
    [
        {"X-Forwarded-For": "198.51.100.7"},
        {"Forwarded": "for=198.51.100.7"},
        {"X-Real-IP": "198.51.100.7"},
    ],
)
def test_forwarded_headers_from_anyone_else_are_ignored(headers: dict[str, str]) -> None:
    assert client_address(request("127.0.0.1", headers), DEFAULT) == "127.0.0.1"
    assert client_address(request("203.0.113.9", headers), NGINX) == "203.0.113.9"


@pytest.mark.parametrize(
    "headers",
    [
        {"X-Forwarded-For": "198.51.100.7"},
        {"X-Forwarded-For": "6.6.6.6, 198.51.100.7"},  # the client's own claim comes first
        [("X-Forwarded-For", "6.6.6.6"), ("X-Forwarded-For", "198.51.100.7, 10.0.0.5")],
        {"Forwarded": 'for="6.6.6.6", for=198.51.100.7;proto=https'},
        {"X-Real-IP": "198.51.100.7"},
        {"X-Forwarded-For": "198.51.100.7:5555"},
    ],
)
def test_a_listed_proxy_names_the_nearest_address_it_does_not_list(headers: object) -> None:
    assert client_address(request("10.0.0.5", headers), NGINX) == "198.51.100.7"  # type: ignore[arg-type]


def test_ipv6_and_unparsable_hops() -> None:
    got = client_address(request("fd00::2", {"Forwarded": 'for="[2001:db8::1]:4711"'}), NGINX)
    assert got == "2001:db8::1"
    # Garbage from a listed proxy names nobody: the proxy itself is the client.
    assert client_address(request("10.0.0.5", {"X-Forwarded-For": "nginx, ;"}), NGINX) == "10.0.0.5"
    assert forwarded_chain(request("x", {"X-Forwarded-For": "1.2.3.4, junk"}).headers) == [
        "1.2.3.4"
    ]


def test_trusted_proxies_must_be_addresses_or_networks() -> None:
    with pytest.raises(ValueError, match="is not an IP address or network"):
        GatewaySettings(trusted_proxies=["nginx"])
