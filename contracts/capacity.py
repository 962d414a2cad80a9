"""The capacity arithmetic every layer shares: the largest request a path can take, and how a
window larger than a real pool (drift) is stated.

The engine's core, its server and the gateway all compute "prompt + max_tokens may be at most the
smallest of the advertised window, every role's real KV pool and every role's own limit" and say
"context window W exceeds ... real KV pool of P tokens; requests are limited to L tokens" with
these two functions, so a limit or a drift report cannot read differently at different layers.
Pure (standard library only): ``backend.core`` imports it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol


class RoleLimits(Protocol):
    @property
    def pool_tokens(self) -> int | None: ...

    @property
    def max_request_tokens(self) -> int | None: ...


def path_max_request_tokens(window: int, roles: Iterable[RoleLimits], *more: int | None) -> int:
    """The largest prompt + max_tokens a request can have on a path: the smallest of the
    advertised window, every role's real KV pool and own limit, and any further limit given
    (None: not known, so not a limit)."""
    limits = [window]
    for role in roles:
        limits += [
            value for value in (role.pool_tokens, role.max_request_tokens) if value is not None
        ]
    limits += [value for value in more if value is not None]
    return min(limits)


def drift_message(
    window: int, pool_tokens: int, max_request_tokens: int, *, role: str = "", detail: str = ""
) -> str:
    """Why an advertised window is not what a path can serve (``window > pool_tokens``); ``role``
    names whose pool it is when the path has several."""
    whose = f"the {role} role's" if role else "the"
    return (
        f"context window {window} exceeds {whose} real KV pool of {pool_tokens} tokens{detail}; "
        f"requests are limited to {max_request_tokens} tokens"
    )
