"""What the HTTP routes need from a running engine, gathered in one object built in the lifespan."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from backend.core.admission import CapacityLimits
from backend.core.pages import PagePool
from backend.engine.async_engine import AsyncEngine
from backend.metrics import EngineMetrics
from backend.model.tokenizer import Tokenizer
from backend.server.openai_schema import ChatMessage
from backend.server.schema import CapacityReport, Role, RoleCapacity

PROTOCOL_VERSION = 1


@dataclass(slots=True)
class EngineService:
    engine: AsyncEngine
    tokenizer: Tokenizer
    model_name: str
    role: Role
    limits: CapacityLimits
    pool: PagePool
    metrics: EngineMetrics
    render_chat: Callable[[Sequence[ChatMessage]], str]
    zero_on_free: bool
    request_timeout_s: float
    faults: list[str] = field(default_factory=list)

    def encode_prompt(self, text: str) -> list[int]:
        ids = self.tokenizer.encode(text)
        bos = self.tokenizer.bos_id
        return [bos, *ids] if bos is not None else ids

    def capacity(self) -> CapacityReport:
        limits, pool = self.limits, self.pool
        role = RoleCapacity(
            role=self.role,
            page_size=limits.page_size,
            pool_pages=limits.pool_pages,
            pool_tokens=limits.pool_tokens,
            free_pages=pool.free_pages,
            quarantined_pages=pool.quarantined_pages,
            context_window=limits.context_window,
            max_request_tokens=limits.max_request_tokens,
        )
        return CapacityReport(
            model=self.model_name,
            role=self.role,
            protocol_version=PROTOCOL_VERSION,
            page_size=limits.page_size,
            pool_pages=limits.pool_pages,
            pool_tokens=limits.pool_tokens,
            free_pages=pool.free_pages,
            quarantined_pages=pool.quarantined_pages,
            context_window=limits.context_window,
            max_request_tokens=limits.max_request_tokens,
            zero_on_free=self.zero_on_free,
            drift=limits.drift,
            faults=list(self.faults),
            roles=[role],
        )
