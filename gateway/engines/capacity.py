"""Capacity truth: what an engine really holds, and the limit the gateway enforces from it.

An adapter turns an engine's own introspection payload into a ``CapacitySnapshot``. The largest
request (prompt + max_tokens) the gateway lets through to that engine, its ``max_request_tokens``,
is the smallest of: the advertised window, every role's real KV pool, every role's own request
limit, and the engine's end-to-end request limit (``contracts.capacity.path_max_request_tokens``,
as the engine computes its own). An advertised window larger than the real pool is capacity
*drift*: flagged, never trusted (the limit is the pool). One name along the whole path: the
engine's ``max_request_tokens``, the snapshot's, a tenant's (``max_request_tokens_for``: capped by
its plan), and the refusal's; only ``GET /v1/models`` says ``max_model_len``, the name OpenAI-
compatible clients read.

An engine group (an SGLang or vLLM deployment behind a router) is one snapshot whose roles are
every member's roles, named after the member: the minimum over every pool a request can land in is
then the same ``max_request_tokens`` as for one engine, computed here and nowhere else.

Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from contracts.capacity import drift_message, path_max_request_tokens


@dataclass(frozen=True, slots=True)
class RoleView:
    role: str
    pool_tokens: int | None  # None: this role's pool could not be measured
    max_request_tokens: int | None = None
    free_tokens: int | None = None
    page_size: int | None = None
    age_s: float | None = None  # how old the engine's own view of this (peer) role is
    unknown_reason: str | None = None  # why pool_tokens is None, and what to enable
    pool_declared: bool = False  # the pool is the operator's declaration (cross-checked)


@dataclass(frozen=True, slots=True)
class TokenizeTarget:
    """Where this engine's prompts are counted: a URL the engine (or one member) serves."""

    url: str
    member: str | None = None  # the group member that serves it (its key is used)
    chat_refused: str | None = None  # why it cannot count a chat (then refused, never guessed)


@dataclass(frozen=True, slots=True)
class CacheIsolation:
    """Whether requests can carry a per-tenant prefix-cache salt this engine honours."""

    field: str | None  # the request field ("cache_salt"), None: no isolation on this engine
    detail: str  # the version rule or the reason it cannot isolate


@dataclass(frozen=True, slots=True)
class CapacitySnapshot:
    model: str
    context_window: int  # the advertised window
    roles: tuple[RoleView, ...]
    measured: bool  # False: numbers were declared in config, nothing was read from the engine
    reported_max_request_tokens: int | None = None  # the engine's own end-to-end limit, if any
    max_prompt_tokens: int | None = None  # a prompt-only limit (SGLang's max_req_input_len)
    faults: tuple[str, ...] = ()
    engine_drift: str | None = None  # the engine's own drift statement, if it makes one
    unavailable: str | None = None  # the engine says its serving path cannot serve now
    tokenizer: str | None = None  # the engine's countable tokenizer id (see proxy.admission)
    tokenize: TokenizeTarget | None = None  # None: the adapter's default path on base_url
    isolation: CacheIsolation | None = None
    version: str | None = None  # the engine's own version string, when it reports one
    # OpenAI request features the engine itself reports serving (``CapacityReport.features``)
    features: frozenset[str] = frozenset()

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
    def unknown_pools(self) -> str | None:
        """Which roles' pools are unknown and why (the reason an operator acts on)."""
        reasons = [
            f"{role.role}: {role.unknown_reason or 'pool not measured'}"
            for role in self.roles
            if role.pool_tokens is None
        ]
        return "; ".join(reasons) or None

    @property
    def max_request_tokens(self) -> int:
        """The largest prompt + max_tokens the gateway lets through to this engine."""
        return path_max_request_tokens(
            self.context_window, self.roles, self.reported_max_request_tokens
        )

    @property
    def free_tokens(self) -> int | None:
        free = [role.free_tokens for role in self.roles if role.free_tokens is not None]
        return min(free) if free else None

    @property
    def drift(self) -> str | None:
        """Why the advertised window cannot be trusted, or None."""
        if self.engine_drift:
            return self.engine_drift  # the engine's own words already name window and pool
        limit = self.max_request_tokens
        reasons = [
            drift_message(self.context_window, role.pool_tokens, limit, role=role.role)
            for role in self.roles
            if role.pool_tokens is not None and self.context_window > role.pool_tokens
        ]
        return "; ".join(reasons) or None


def group_snapshot(
    model: str, members: Sequence[tuple[str, CapacitySnapshot]], *, tokenize: TokenizeTarget
) -> CapacitySnapshot:
    """One snapshot for a deployment: every member's roles (renamed ``member/role``) on one path.

    The window and prompt limit are the smallest any member reports (a request may land on any);
    an engine-level request limit becomes a role limit of its member, so ``max_request_tokens``
    stays the one place where the minimum is taken. Isolation holds only if every member has it.
    """
    roles: list[RoleView] = []
    for name, part in members:
        for role in part.roles:
            limit = _smallest(role.max_request_tokens, part.reported_max_request_tokens)
            roles.append(replace(role, role=f"{name}/{role.role}", max_request_tokens=limit))
    prompt_limits = [p.max_prompt_tokens for _, p in members if p.max_prompt_tokens is not None]
    drifts = [f"{name}: {p.engine_drift}" for name, p in members if p.engine_drift]
    unavailable = [f"{name}: {p.unavailable}" for name, p in members if p.unavailable]
    return CapacitySnapshot(
        model=model,
        context_window=min(part.context_window for _, part in members),
        roles=tuple(roles),
        measured=all(part.measured for _, part in members),
        max_prompt_tokens=min(prompt_limits) if prompt_limits else None,
        faults=tuple(dict.fromkeys(f for _, part in members for f in part.faults)),
        engine_drift="; ".join(drifts) or None,
        unavailable="; ".join(unavailable) or None,
        tokenize=tokenize,
        isolation=_group_isolation(members),
        version=", ".join(sorted({p.version for _, p in members if p.version})) or None,
    )


def _smallest(*values: int | None) -> int | None:
    known = [value for value in values if value is not None]
    return min(known) if known else None


def _group_isolation(members: Sequence[tuple[str, CapacitySnapshot]]) -> CacheIsolation:
    fields = {part.isolation.field if part.isolation else None for _, part in members}
    if len(fields) == 1 and None not in fields:
        field = fields.pop()
        return CacheIsolation(field=field, detail="every member honours " + str(field))
    lacking = [
        f"{name}: {part.isolation.detail if part.isolation else 'unknown'}"
        for name, part in members
        if part.isolation is None or part.isolation.field is None
    ]
    return CacheIsolation(field=None, detail="; ".join(lacking) or "members disagree")


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
    return size.total <= max_request_tokens_for(snapshot, plan_cap)


def max_request_tokens_for(snapshot: CapacitySnapshot, plan_cap: int | None) -> int:
    """The largest request on this engine for a tenant whose plan caps context at plan_cap."""
    limit = snapshot.max_request_tokens
    return limit if plan_cap is None else min(limit, plan_cap)
