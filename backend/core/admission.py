"""Admission: refuse a request that can never fit, before a single page is reserved.

The limit is ``min(context_window, pool_tokens)``: the advertised window is a promise, the pool is
what the running engine really has, and the smaller one wins. ``CapacityLimits.from_pool`` derives
the pool side from the live ``PagePool`` so the two numbers cannot be configured apart; ``drift``
describes the case the incident began with (a window larger than the pool) so it can be reported.

A request is sized as prompt + max_tokens. Strictly its KV needs one token less (the last sampled
token is never fed back), but this is the number tenants, the gateway and the page reservation all
compute, so every layer refuses at the same boundary.
"""

from __future__ import annotations

from dataclasses import dataclass

from backend.core.errors import ContextLengthExceeded, InvalidRequest, LimitReason
from backend.core.pages import PagePool
from contracts.capacity import drift_message


@dataclass(frozen=True, slots=True)
class CapacityLimits:
    page_size: int
    pool_pages: int
    context_window: int

    def __post_init__(self) -> None:
        if self.page_size < 1 or self.pool_pages < 0 or self.context_window < 1:
            raise ValueError(
                f"invalid capacity: page_size={self.page_size}, pool_pages={self.pool_pages}, "
                f"context_window={self.context_window}"
            )

    @classmethod
    def from_pool(cls, pool: PagePool, context_window: int) -> CapacityLimits:
        """Limits measured from the running pool (the only way the engine should build them)."""
        return cls(pool.page_size, pool.num_pages, context_window)

    @property
    def pool_tokens(self) -> int:
        return self.page_size * self.pool_pages

    @property
    def max_request_tokens(self) -> int:
        """Largest prompt + max_tokens this engine can ever accept."""
        return min(self.context_window, self.pool_tokens)

    @property
    def binding_limit(self) -> LimitReason:
        """Which number sets ``max_request_tokens`` (the window, unless the pool is smaller)."""
        if self.pool_tokens < self.context_window:
            return LimitReason.KV_POOL
        return LimitReason.CONTEXT_WINDOW

    @property
    def drift(self) -> str | None:
        """None, or why the advertised window is not what this engine can really serve."""
        if self.context_window <= self.pool_tokens:
            return None
        pages = f" ({self.pool_pages} pages x {self.page_size})"
        return drift_message(
            self.context_window, self.pool_tokens, self.max_request_tokens, detail=pages
        )


def admit(prompt_tokens: int, max_tokens: int, limits: CapacityLimits) -> None:
    """Raise ``InvalidRequest`` or ``ContextLengthExceeded`` unless the request can ever fit."""
    if prompt_tokens < 1:
        raise InvalidRequest("prompt", "must contain at least one token")
    if max_tokens < 1:
        raise InvalidRequest("max_tokens", f"must be >= 1, got {max_tokens}")
    requested = prompt_tokens + max_tokens
    if requested > limits.max_request_tokens:
        raise ContextLengthExceeded(
            limits.max_request_tokens,
            requested,
            prompt_tokens,
            max_tokens,
            limits.binding_limit,
            limits.pool_tokens,
            limits.context_window,
        )
