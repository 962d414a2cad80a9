"""The versioned prefill -> decode handoff messages, and their wire codec.

One handoff, as messages (decode is the entry point; prefill writes KV with one-sided writes)::

    client ─HTTP─▶ decode                                        prefill
                   1. admission: min(own pool, prefill's pool)
                   2. reserve pages (AWAITING_KV)
                   3. PrefillRequest ──────────────────────────▶ 4. version check; own admission
                      version, request id, tenant, prompt ids,      (REJECTED: reply at once)
                      sampling (biases, logprobs asked),         5. compute the prompt's KV,
                      reserved pages + generations, target          stage it, sample the first
                      memory layout, batch limit, lease             token (with its logprobs)
                                        ◀═══ one-sided writes ══ 6. <= batch-limit pages/batch
                   8. verify, positive evidence only ◀───────── 7. PrefillResult, sent only when
                      outcome OK; transferred == reserved;          no write is in flight: outcome
                      pages + generations == reserved, still        OK|REJECTED|ABORTED|FAILED,
                      current and ours; checksum equal;             range, pages, checksum, token
                      the token's logprobs iff asked                (+ its logprobs if asked)
                   9. accept -> DECODING, or end the request with the original error

    Abort (client gone, timeout): decode quarantines the pages and sends AbortRequest; prefill
    stops between batches and answers AbortAck(quiesced) once no write is in flight; decode frees
    only then, or after a drain bound justified by the batch limit (``backend.disagg.machines``).

Every message carries ``protocol_version``; ``check_version`` runs before anything else is parsed,
so a peer on another version is refused explicitly (``ProtocolVersionMismatch``) in both
directions. Messages are frozen dataclasses; the codec (``to_wire`` / ``*_from_wire``) turns them
into plain JSON-able dicts and refuses unknown fields, missing fields and wrong types. Token ids
and the first token are content: reprs leave them out. Pure: no torch, no HTTP, no environment.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, TypeVar

from backend.core.grammar import GrammarKind, GrammarSpec
from backend.core.messages import TokenLogprobs
from backend.disagg.errors import MalformedMessage, ProtocolVersionMismatch

# 2: SamplingSpec carries logit_bias and logprobs (prefill samples the first token with the
# biases) and an OK PrefillResult carries the first token's logprobs when they were asked for.
# 3: SamplingSpec carries the request's grammar: prefill samples the first token under it, and
# decode rebuilds the grammar's state from the same spec, replaying that token
# (``backend.core.grammar``; a token it does not accept fails the request).
PROTOCOL_VERSION = 3

DTYPE_BYTES: Mapping[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2}


class HandoffOutcome(StrEnum):
    """What prefill says happened, always explicit: never just "done"."""

    OK = "ok"
    REJECTED = "rejected"
    ABORTED = "aborted"
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class PageGrant:
    """One reserved decode page, named by id and the generation of this allocation."""

    page_id: int
    generation: int


@dataclass(frozen=True, slots=True)
class TokenRange:
    """Prompt positions ``[start, end)``."""

    start: int
    end: int

    def __post_init__(self) -> None:
        if not 0 <= self.start <= self.end:
            raise ValueError(f"bad token range [{self.start}, {self.end})")

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


@dataclass(frozen=True, slots=True)
class KvLayout:
    """Geometry of a KV pool tensor ``[layers, pages, page_size, kv_heads, head_dim]``."""

    num_layers: int
    num_pages: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str

    @property
    def token_bytes(self) -> int:
        return self.num_kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]

    @property
    def page_bytes(self) -> int:
        return self.page_size * self.token_bytes

    @property
    def layer_bytes(self) -> int:
        return self.num_pages * self.page_bytes

    def offset(self, layer: int, page_id: int) -> int:
        """Byte offset of ``page_id`` of ``layer`` from the tensor's base address."""
        return layer * self.layer_bytes + page_id * self.page_bytes

    def same_geometry(self, other: KvLayout) -> bool:
        """Whether KV in ``other``'s format means the same in this one (page counts may differ)."""

        def geometry(layout: KvLayout) -> tuple[int, int, int, int, str]:
            return (
                layout.num_layers,
                layout.page_size,
                layout.num_kv_heads,
                layout.head_dim,
                layout.dtype,
            )

        return geometry(self) == geometry(other)


@dataclass(frozen=True, slots=True)
class TransferTarget:
    """Where prefill may write: decode's transfer endpoint and its registered K and V pools.

    ``instance_id`` names one decode process lifetime: messages for another instance (a decode
    that restarted) are refused. ``max_batch_pages`` is the transfer-batch limit decode's drain
    bound is derived from; prefill must never have more pages than that in flight.
    """

    endpoint: str
    instance_id: str
    k_base: int
    v_base: int
    layout: KvLayout
    max_batch_pages: int


@dataclass(frozen=True, slots=True)
class SamplingSpec:
    """What prefill needs to sample the first token as decode's engine would: penalties are
    left out, since they count generated tokens and the first has none before it."""

    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    stop_token_ids: tuple[int, ...]
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), as SamplingParams
    logprobs: int | None = None  # report the first token's logprob and this many alternatives
    grammar: GrammarSpec | None = None  # the first token is sampled under it


@dataclass(frozen=True, slots=True)
class PrefillRequest:
    protocol_version: int
    request_id: str
    tenant: str
    prompt_ids: tuple[int, ...] = field(repr=False)
    sampling: SamplingSpec
    reserved_tokens: int
    pages: tuple[PageGrant, ...]
    target: TransferTarget
    lease_s: float

    def __post_init__(self) -> None:
        if self.reserved_tokens != len(self.prompt_ids) or self.reserved_tokens < 1:
            raise ValueError("reserved_tokens must equal the prompt length (>= 1)")
        needed = -(-self.reserved_tokens // self.target.layout.page_size)
        if len(self.pages) != needed:
            raise ValueError(f"{len(self.pages)} pages granted for {needed} pages of prompt")
        if self.lease_s <= 0 or self.target.max_batch_pages < 1:
            raise ValueError("lease_s and max_batch_pages must be positive")


@dataclass(frozen=True, slots=True)
class ErrorInfo:
    """A typed error crossing the wire: its stable code, HTTP status and message."""

    code: str
    http_status: int
    message: str


@dataclass(frozen=True, slots=True)
class PrefillResult:
    """Prefill's one reply; sent only from a terminal state, i.e. with no write in flight."""

    protocol_version: int
    request_id: str
    instance_id: str
    outcome: HandoffOutcome
    error: ErrorInfo | None
    transferred: TokenRange | None
    pages_written: tuple[PageGrant, ...]
    checksum: str | None
    first_token: int | None = field(repr=False)
    transfer_s: float = 0.0
    checksum_s: float = 0.0
    first_token_logprobs: TokenLogprobs | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.outcome is HandoffOutcome.OK:
            if self.transferred is None or self.checksum is None or self.first_token is None:
                raise ValueError("an OK result needs transferred, checksum and first_token")
        elif self.error is None and self.outcome is not HandoffOutcome.ABORTED:
            raise ValueError(f"a {self.outcome} result needs the error that caused it")
        if self.first_token is None and self.first_token_logprobs is not None:
            raise ValueError("first_token_logprobs without a first_token")


@dataclass(frozen=True, slots=True)
class AbortRequest:
    protocol_version: int
    request_id: str
    instance_id: str


@dataclass(frozen=True, slots=True)
class AbortAck:
    """``quiesced``: prefill guarantees no write for this request is or will be in flight."""

    protocol_version: int
    request_id: str
    instance_id: str
    quiesced: bool
    state: str


Message = PrefillRequest | PrefillResult | AbortRequest | AbortAck


# -- codec --------------------------------------------------------------------------------------


def check_version(payload: object, where: str, local: int = PROTOCOL_VERSION) -> None:
    """Refuse a message from another protocol version before reading anything else in it."""
    remote = payload.get("protocol_version") if isinstance(payload, dict) else None
    if type(remote) is not int or remote != local:
        raise ProtocolVersionMismatch(local, remote, where)


def to_wire(message: Message | PageGrant | TokenRange | ErrorInfo) -> dict[str, Any]:
    """A message as a JSON-able dict (enums as their values, tuples as lists)."""
    out: dict[str, Any] = {}
    for name in message.__dataclass_fields__:
        out[name] = _plain(getattr(message, name))
    return out


def _plain(value: object) -> object:
    if isinstance(value, StrEnum):
        return value.value
    if hasattr(value, "__dataclass_fields__"):
        return {n: _plain(getattr(value, n)) for n in value.__dataclass_fields__}
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value


class _Reader:
    """Strict field access over one dict: exact key set, exact types."""

    def __init__(self, kind: str, payload: object, keys: frozenset[str]) -> None:
        if not isinstance(payload, dict):
            raise MalformedMessage(kind, "not an object")
        if set(payload) != keys:
            extra, missing = sorted(set(payload) - keys), sorted(keys - set(payload))
            raise MalformedMessage(kind, f"unknown fields {extra}, missing fields {missing}")
        self.kind, self.payload = kind, payload

    def integer(self, key: str, minimum: int = 0) -> int:
        value = self.payload[key]
        if type(value) is not int or value < minimum:
            raise MalformedMessage(self.kind, f"{key} must be an integer >= {minimum}")
        return value

    def opt_integer(self, key: str) -> int | None:
        return None if self.payload[key] is None else self.integer(key)

    def number(self, key: str) -> float:
        value = self.payload[key]
        if type(value) not in (int, float):
            raise MalformedMessage(self.kind, f"{key} must be a number")
        return float(value)

    def text(self, key: str) -> str:
        value = self.payload[key]
        if not isinstance(value, str) or not value or len(value) > 256:
            raise MalformedMessage(self.kind, f"{key} must be a non-empty string")
        return value

    def opt_text(self, key: str) -> str | None:
        return None if self.payload[key] is None else self.text(key)

    def flag(self, key: str) -> bool:
        value = self.payload[key]
        if type(value) is not bool:
            raise MalformedMessage(self.kind, f"{key} must be a boolean")
        return value

    def pairs(self, key: str) -> tuple[tuple[int, float], ...]:
        """A list of ``[token id, number]`` pairs (biases, alternatives' logprobs)."""
        value = self.payload[key]
        if not isinstance(value, list) or not all(_is_pair(item) for item in value):
            raise MalformedMessage(self.kind, f"{key} must be a list of [token id, number] pairs")
        return tuple((item[0], float(item[1])) for item in value)

    def integers(self, key: str) -> tuple[int, ...]:
        value = self.payload[key]
        if not isinstance(value, list) or any(type(v) is not int or v < 0 for v in value):
            raise MalformedMessage(self.kind, f"{key} must be a list of non-negative integers")
        return tuple(value)

    def each(self, key: str, parse: Callable[[object], _T]) -> tuple[_T, ...]:
        value = self.payload[key]
        if not isinstance(value, list):
            raise MalformedMessage(self.kind, f"{key} must be a list")
        return tuple(parse(item) for item in value)

    def sub(self, key: str) -> object:
        return self.payload[key]


_T = TypeVar("_T")


def _is_pair(item: object) -> bool:
    return (
        isinstance(item, list)
        and len(item) == 2
        and type(item[0]) is int
        and item[0] >= 0
        and type(item[1]) in (int, float)
    )


def _keys(cls: type) -> frozenset[str]:
    return frozenset(cls.__dataclass_fields__)  # type: ignore[attr-defined]


def _build(kind: str, make: Callable[[], _T]) -> _T:
    try:
        return make()
    except (ValueError, KeyError) as exc:
        raise MalformedMessage(kind, str(exc)) from exc


def _grant(payload: object) -> PageGrant:
    r = _Reader("PageGrant", payload, _keys(PageGrant))
    return _build("PageGrant", lambda: PageGrant(r.integer("page_id"), r.integer("generation", 1)))


def _range(payload: object) -> TokenRange | None:
    if payload is None:
        return None
    r = _Reader("TokenRange", payload, _keys(TokenRange))
    return _build("TokenRange", lambda: TokenRange(r.integer("start"), r.integer("end")))


def _error(payload: object) -> ErrorInfo | None:
    if payload is None:
        return None
    r = _Reader("ErrorInfo", payload, _keys(ErrorInfo))
    return ErrorInfo(r.text("code"), r.integer("http_status", 100), r.text("message"))


def _layout(payload: object) -> KvLayout:
    r = _Reader("KvLayout", payload, _keys(KvLayout))
    dtype = r.text("dtype")
    if dtype not in DTYPE_BYTES:
        raise MalformedMessage("KvLayout", f"unknown dtype {dtype!r}")
    return KvLayout(
        r.integer("num_layers", 1),
        r.integer("num_pages", 1),
        r.integer("page_size", 1),
        r.integer("num_kv_heads", 1),
        r.integer("head_dim", 1),
        dtype,
    )


def _target(payload: object) -> TransferTarget:
    r = _Reader("TransferTarget", payload, _keys(TransferTarget))
    return TransferTarget(
        r.text("endpoint"),
        r.text("instance_id"),
        r.integer("k_base", 1),
        r.integer("v_base", 1),
        _layout(r.sub("layout")),
        r.integer("max_batch_pages", 1),
    )


def _sampling(payload: object) -> SamplingSpec:
    r = _Reader("SamplingSpec", payload, _keys(SamplingSpec))
    return SamplingSpec(
        r.integer("max_tokens", 1),
        r.number("temperature"),
        r.number("top_p"),
        r.opt_integer("seed"),
        r.integers("stop_token_ids"),
        r.pairs("logit_bias"),
        r.opt_integer("logprobs"),
        _grammar(r.sub("grammar")),
    )


MAX_GRAMMAR_CHARS = 1 << 20


def _grammar(payload: object) -> GrammarSpec | None:
    if payload is None:
        return None
    r = _Reader("GrammarSpec", payload, _keys(GrammarSpec))
    kind, schema = r.sub("kind"), r.sub("schema")
    if not isinstance(kind, str) or kind not in tuple(GrammarKind):
        raise MalformedMessage("GrammarSpec", f"unknown kind {str(kind)[:32]!r}")
    if schema is not None and (not isinstance(schema, str) or len(schema) > MAX_GRAMMAR_CHARS):
        raise MalformedMessage("GrammarSpec", "schema must be a string of JSON or null")
    return _build("GrammarSpec", lambda: GrammarSpec(GrammarKind(kind), schema, r.flag("strict")))


def _logprobs(payload: object) -> TokenLogprobs | None:
    if payload is None:
        return None
    r = _Reader("TokenLogprobs", payload, _keys(TokenLogprobs))
    return TokenLogprobs(r.number("logprob"), r.pairs("top"))


def prefill_request_from_wire(payload: object, local: int = PROTOCOL_VERSION) -> PrefillRequest:
    check_version(payload, "prefill request", local)
    r = _Reader("PrefillRequest", payload, _keys(PrefillRequest))
    return _build(
        "PrefillRequest",
        lambda: PrefillRequest(
            r.integer("protocol_version"),
            r.text("request_id"),
            r.text("tenant"),
            r.integers("prompt_ids"),
            _sampling(r.sub("sampling")),
            r.integer("reserved_tokens", 1),
            r.each("pages", _grant),
            _target(r.sub("target")),
            r.number("lease_s"),
        ),
    )


def prefill_result_from_wire(payload: object, local: int = PROTOCOL_VERSION) -> PrefillResult:
    check_version(payload, "prefill result", local)
    r = _Reader("PrefillResult", payload, _keys(PrefillResult))
    outcome = r.text("outcome")
    if outcome not in HandoffOutcome._value2member_map_:
        raise MalformedMessage("PrefillResult", f"unknown outcome {outcome!r}")
    return _build(
        "PrefillResult",
        lambda: PrefillResult(
            r.integer("protocol_version"),
            r.text("request_id"),
            r.text("instance_id"),
            HandoffOutcome(outcome),
            _error(r.sub("error")),
            _range(r.sub("transferred")),
            r.each("pages_written", _grant),
            r.opt_text("checksum"),
            r.opt_integer("first_token"),
            r.number("transfer_s"),
            r.number("checksum_s"),
            _logprobs(r.sub("first_token_logprobs")),
        ),
    )


def abort_request_from_wire(payload: object, local: int = PROTOCOL_VERSION) -> AbortRequest:
    check_version(payload, "abort request", local)
    r = _Reader("AbortRequest", payload, _keys(AbortRequest))
    return AbortRequest(r.integer("protocol_version"), r.text("request_id"), r.text("instance_id"))


def abort_ack_from_wire(payload: object, local: int = PROTOCOL_VERSION) -> AbortAck:
    check_version(payload, "abort ack", local)
    r = _Reader("AbortAck", payload, _keys(AbortAck))
    return AbortAck(
        r.integer("protocol_version"),
        r.text("request_id"),
        r.text("instance_id"),
        r.flag("quiesced"),
        r.text("state"),
    )
