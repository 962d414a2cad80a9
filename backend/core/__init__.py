"""Pure bookkeeping core of the bundled paged-KV engine: pages, requests, admission, scheduling.

No torch, no HTTP, no environment, no I/O: the model runner and the server drive this core as
``schedule() -> run model -> postprocess()`` (see ``backend.core.messages``).
"""

from backend.core.admission import CapacityLimits, admit
from backend.core.errors import (
    ContextLengthExceeded,
    DuplicateRequestId,
    InvalidRequest,
    InvalidTransition,
    InvariantViolation,
    IsolationError,
    IsolationReason,
    KvguardError,
    LimitReason,
    OutOfPages,
    StepProtocolError,
)
from backend.core.messages import DecodeItem, PrefillChunk, SchedulerOutput, StepResult
from backend.core.pages import (
    PAGE_TRANSITIONS,
    Owner,
    PagePool,
    PageRef,
    PageSnapshot,
    PageState,
    pages_needed,
)
from backend.core.request import (
    TERMINAL,
    TRANSITIONS,
    FinishReason,
    Request,
    RequestState,
    SamplingParams,
)
from backend.core.scheduler import Scheduler

__all__ = [
    "PAGE_TRANSITIONS",
    "TERMINAL",
    "TRANSITIONS",
    "CapacityLimits",
    "ContextLengthExceeded",
    "DecodeItem",
    "DuplicateRequestId",
    "FinishReason",
    "InvalidRequest",
    "InvalidTransition",
    "InvariantViolation",
    "IsolationError",
    "IsolationReason",
    "KvguardError",
    "LimitReason",
    "OutOfPages",
    "Owner",
    "PagePool",
    "PageRef",
    "PageSnapshot",
    "PageState",
    "PrefillChunk",
    "Request",
    "RequestState",
    "SamplingParams",
    "Scheduler",
    "SchedulerOutput",
    "StepProtocolError",
    "StepResult",
    "admit",
    "pages_needed",
]
