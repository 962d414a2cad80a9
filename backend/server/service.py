"""What the HTTP routes need from a running engine, gathered in one object built in the lifespan.

One class for every role. The decode role plugs in its ``PathGuard`` (prefill's capacity, kept
fresh, and the cross-role admission) so ``submit`` refuses before anything is reserved, and
``capacity`` reports both roles and the largest request the pair can serve.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from backend.core.admission import CapacityLimits
from backend.core.errors import InvalidRequest
from backend.core.grammar import GrammarSpec
from backend.core.pages import PagePool
from backend.core.request import SamplingParams
from backend.disagg.protocol import PROTOCOL_VERSION
from backend.engine.async_engine import AsyncEngine, Generation
from backend.engine.grammar import GrammarBackend
from backend.metrics import EngineMetrics
from backend.model.chat import ChatFormat, ChatTemplateRefused
from backend.model.tokenizer import HFTokenizer, Tokenizer
from backend.model.tool_calls import HERMES, ToolCallFormat
from backend.server.openai_schema import ChatMessage
from backend.server.structured import Mode, OutputPlan
from contracts.capacity import drift_message, path_max_request_tokens
from contracts.engine import STRUCTURED_FEATURES, CapacityReport, Role, RoleCapacity


class PathGuard(Protocol):
    """The rest of the serving path, as the entry point sees it (decode: the prefill role)."""

    def admit(self, prompt_tokens: int, max_tokens: int) -> None:
        """Raise the typed error the client should get, before anything is reserved."""

    def peer_roles(self) -> list[RoleCapacity]:
        """The other roles' last fresh capacity (empty while unknown)."""

    def unavailable(self) -> str | None:
        """Why the path cannot serve now, or None."""


@dataclass(slots=True)
class EngineService:
    engine: AsyncEngine
    tokenizer: Tokenizer
    model_name: str
    role: Role
    limits: CapacityLimits
    pool: PagePool
    metrics: EngineMetrics
    chat: ChatFormat
    zero_on_free: bool
    request_timeout_s: float
    faults: list[str] = field(default_factory=list)
    tokenizer_id: str | None = None  # see CapacityReport.tokenizer
    protocol_version: int = PROTOCOL_VERSION
    guard: PathGuard | None = None
    read_log: Callable[[], list[dict[str, Any]]] | None = None  # drills only
    grammar: GrammarBackend | None = None  # None: no structured output, no tools
    tool_format: ToolCallFormat = HERMES  # how this checkpoint writes tool calls

    def render_chat(
        self, messages: Sequence[ChatMessage], tools: list[dict[str, Any]] | None = None
    ) -> str:
        """The prompt text of a conversation (and the tools it may call, when given); a
        conversation the template rejects is a 400."""
        try:
            return self.chat([m.turn() for m in messages], tools)
        except ChatTemplateRefused as exc:
            raise InvalidRequest(
                "messages", f"the model's chat template refused them: {exc}"
            ) from exc

    def compile_grammar(self, spec: GrammarSpec, tenant: str) -> None:
        """Compile (and cache) a request's grammar before anything is reserved; a schema that
        cannot be used is a 400."""
        if self.grammar is None:
            raise InvalidRequest("response_format", "this engine serves no structured output")
        self.grammar.compile(spec, tenant)

    def kept_specials(self, plan: OutputPlan) -> dict[int, str]:
        """Special tokens whose text the tool-call parser must see (``TextStream.kept``)."""
        if plan.mode is not Mode.AUTO or not isinstance(self.tokenizer, HFTokenizer):
            return {}
        ids = {text: self.tokenizer.token_id(text) for text in plan.fmt.kept_specials}
        return {token: text for text, token in ids.items() if token is not None}

    def encode_prompt(self, text: str, *, chat: bool = False) -> list[int]:
        """Token ids of a prompt as the tokenizer encodes it (with the special tokens it adds),
        or of a rendered chat (whose template wrote its own, when it has one)."""
        specials_in_text = chat and self.chat.special_tokens_in_text
        return self.tokenizer.encode(text, add_special_tokens=not specials_in_text)

    def submit(
        self, *, request_id: str, tenant: str, prompt_ids: list[int], sampling: SamplingParams
    ) -> Generation:
        """Admission on the whole path first (raises KvguardError), then the engine's own."""
        if self.guard is not None:
            self.guard.admit(len(prompt_ids), sampling.max_tokens)
        return self.engine.submit(
            request_id=request_id, tenant=tenant, prompt_ids=prompt_ids, sampling=sampling
        )

    def available_pages(self) -> int:
        """Free pages and idle prefix-cache pages: what a new request can have now."""
        return self.engine.core.scheduler.kv.available_pages

    def own_role(self) -> RoleCapacity:
        limits, pool = self.limits, self.pool
        return RoleCapacity(
            role=self.role,
            page_size=limits.page_size,
            pool_pages=limits.pool_pages,
            pool_tokens=limits.pool_tokens,
            free_pages=self.available_pages(),
            quarantined_pages=pool.quarantined_pages,
            context_window=limits.context_window,
            max_request_tokens=limits.max_request_tokens,
            protocol_version=self.protocol_version,
            drift=limits.drift,
            faults=list(self.faults),
        )

    def capacity(self) -> CapacityReport:
        """This role's own report, widened to the whole path it is the entry point of."""
        own = self.own_role()
        roles = [own]
        unavailable = None
        if self.guard is not None:
            roles += self.guard.peer_roles()
            unavailable = self.guard.unavailable()
        if self.engine.failed is not None:  # nothing is served here until a restart
            unavailable = str(self.engine.failed)
        path_limit = path_max_request_tokens(own.context_window, roles)
        return CapacityReport(
            **own.model_dump(exclude={"max_request_tokens", "drift", "faults", "age_s"}),
            model=self.model_name,
            max_request_tokens=0 if unavailable else path_limit,
            zero_on_free=self.zero_on_free,
            tokenizer=self.tokenizer_id,
            features=sorted(STRUCTURED_FEATURES) if self.grammar is not None else [],
            drift=_path_drift(own, roles, path_limit),
            faults=sorted({f for role in roles for f in role.faults}),
            roles=roles,
            unavailable=unavailable,
        )


def _path_drift(own: RoleCapacity, roles: list[RoleCapacity], path_limit: int) -> str | None:
    """The entry point's window against the smallest real pool on the path."""
    if own.drift is not None:
        return own.drift
    smallest = min(roles, key=lambda r: r.pool_tokens)
    if own.context_window > smallest.pool_tokens:
        return drift_message(
            own.context_window, smallest.pool_tokens, path_limit, role=smallest.role.value
        )
    return None
