"""Capacity truth: what an engine really holds, and the limit the gateway enforces from it.

An adapter turns an engine's own introspection payload into a ``CapacitySnapshot``. The
enforceable limit of a request (prompt + max_tokens) on that engine is the smallest of: the
advertised window, every role's real KV pool, every role's own request limit, and the engine's
end-to-end request limit. An advertised window larger than the real pool is capacity *drift*:
flagged, never trusted (the limit is the pool).

Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RoleView:
    role: str
    pool_tokens: int | None  # None: this role's pool could not be measured
    max_request_tokens: int | None = None
    free_tokens: int | None = None
    page_size: int | None = None
    age_s: float | None = None  # how old the engine's own view of this (peer) role is


@dataclass(frozen=True, slots=True)
class CapacitySnapshot:
    model: str
    context_window: int  # the advertised window
    roles: tuple[RoleView, ...]
    measured: bool  # False: numbers were declared in config, nothing was read from the engine
    max_request_tokens: int | None = None  # the engine's own end-to-end limit, if it reports one
    max_prompt_tokens: int | None = None  # a prompt-only limit (SGLang's max_req_input_len)
    faults: tuple[str, ...] = ()
    engine_drift: str | None = None  # the engine's own drift statement, if it makes one
    unavailable: str | None = None  # the engine says its serving path cannot serve now
    tokenizer: str | None = None  # the engine's countable tokenizer id (see proxy.admission)

    @property
    def oldest_role_age_s(self) -> float:
        ages = [role.age_s for role in self.roles if role.age_s is not None]
        return max(ages, default=0.0)

    @property
    def real_pool(self) -> int | None:
        pools = [role.pool_tokens for role in self.roles if role.pool_tokens is not None]
        return min(pools) if pools else None

    @property
    def pool_known(self) -> bool:
        return bool(self.roles) and all(role.pool_tokens is not None for role in self.roles)

    @property
    def enforceable_limit(self) -> int:
        limits = [self.context_window]
        limits += [role.pool_tokens for role in self.roles if role.pool_tokens is not None]
        limits += [r.max_request_tokens for r in self.roles if r.max_request_tokens is not None]
        if self.max_request_tokens is not None:
            limits.append(self.max_request_tokens)
        return min(limits)

    @property
    def free_tokens(self) -> int | None:
        free = [role.free_tokens for role in self.roles if role.free_tokens is not None]
        return min(free) if free else None

    @property
    def drift(self) -> str | None:
        """Why the advertised window cannot be trusted, or None."""
        if self.engine_drift:
            return self.engine_drift  # the engine's own words already name window and pool
        reasons = []
        for role in self.roles:
            if role.pool_tokens is not None and self.context_window > role.pool_tokens:
                reasons.append(
                    f"advertised window {self.context_window} exceeds the {role.role} role's "
                    f"real KV pool of {role.pool_tokens} tokens"
                )
        return "; ".join(reasons) or None


@dataclass(frozen=True, slots=True)
class RequestSize:
    prompt_tokens: int
    max_tokens: int

    @property
    def total(self) -> int:
        return self.prompt_tokens + self.max_tokens


def fits(snapshot: CapacitySnapshot, size: RequestSize, plan_cap: int | None) -> bool:
    if snapshot.max_prompt_tokens is not None and size.prompt_tokens > snapshot.max_prompt_tokens:
        return False
    return size.total <= limit_for(snapshot, plan_cap)


def limit_for(snapshot: CapacitySnapshot, plan_cap: int | None) -> int:
    """The enforceable limit on this engine for a tenant whose plan caps context at plan_cap."""
    limit = snapshot.enforceable_limit
    return limit if plan_cap is None else min(limit, plan_cap)
