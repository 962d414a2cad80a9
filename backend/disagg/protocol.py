"""The versioned prefill -> decode handoff messages, and their wire codec.

One handoff, as messages (decode is the entry point; prefill writes KV with one-sided writes)::

    client ─HTTP─▶ decode                                        prefill
                   0. DecodeAnnouncement (at start, then with ─▶ records the exact target
                      every capacity read): its transfer target    (host allowed by its peers)
                   1. admission: min(own pool, prefill's pool)
                   2. reserve pages (AWAITING_KV); register their
                      landing slots; draw a fresh seal key
                   3. PrefillRequest ──────────────────────────▶ 4. version check; the target is
                      version, request id, tenant, prompt ids,      exactly an announced one (403);
                      sampling (biases, logprobs asked),            own admission (REJECTED)
                      reserved pages + generations, target,      5. compute the prompt's KV,
                      batch limit, lease, the seal key              stage it, sample the first
                                                                    token (with its logprobs)
                                        ◀═══ one-sided writes ══ 6. sealed pages into the landing
                                                                    slots, <= batch-limit pages
                   8. withdraw the slots, copy them, open ◀────── 7. PrefillResult, sent only when
                      the seals; positive evidence only:            no write is in flight: outcome
                      outcome OK; transferred == reserved;          OK|REJECTED|ABORTED|FAILED,
                      pages + generations == reserved, still        range, pages, checksum, token
                      current and ours; every page sealed for       (+ its logprobs if asked)
                      this handoff; checksum equal; the token's
                      logprobs iff asked
                   9. move the KV into the pages and accept -> DECODING, or end the request with
                      the original error

    Abort (client gone, timeout): decode withdraws the slots, quarantines the pages and sends
    AbortRequest; prefill stops between batches and answers AbortAck(quiesced) once no write is
    in flight; decode frees only then, or after a drain bound justified by the batch limit
    (``backend.disagg.machines``).

The ``open`` channel (``KvChannel.OPEN``, development and benchmarks only: production refuses it)
is the channel before the seal: decode's K and V pools are registered with the transport for the
process's life, prefill writes plaintext straight into the granted pages, and no key is sent.

Every message carries ``protocol_version``; ``check_version`` runs before anything else is parsed,
so a peer on another version is refused explicitly (``ProtocolVersionMismatch``) in both
directions. Messages are frozen dataclasses; the codec (``to_wire`` / ``*_from_wire``) turns them
into plain JSON-able dicts and refuses unknown fields, missing fields and wrong types. Token ids,
the first token and the seal key are content or secret: reprs leave them out. Pure: no torch, no
HTTP, no environment.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType
from typing import Any

from backend.core.grammar import GrammarKind, GrammarSpec
from backend.core.messages import TokenLogprobs
from backend.disagg.errors import MalformedMessage, ProtocolVersionMismatch
from backend.disagg.wire import Reader, build, keys_of

# 2: SamplingSpec carries logit_bias and logprobs (prefill samples the first token with the
# biases) and an OK PrefillResult carries the first token's logprobs when they were asked for.
# 3: the sealed channel: TransferTarget names its channel and bases (landing slots, or the open
# channel's K and V pools), PrefillRequest carries the handoff's seal key, DecodeAnnouncement.
# 4: SamplingSpec carries the request's grammar: prefill samples the first token under it, and
# decode rebuilds the grammar's state from the same spec, replaying that token
# (``backend.core.grammar``; a token it does not accept fails the request).
PROTOCOL_VERSION = 4
SEAL_KEY_BYTES = 32  # AES-256 (backend.disagg.seal)

DTYPE_BYTES: Mapping[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2}


class KvChannel(StrEnum):
    """How KV reaches decode's pages (see the module docstring)."""

    SEALED = "sealed"  # per-handoff landing slots, every page sealed under the handoff's key
    OPEN = "open"  # decode's pools registered, plaintext written into them (never production)


BASES: Mapping[KvChannel, tuple[str, ...]] = MappingProxyType(
    {KvChannel.SEALED: ("landing slots",), KvChannel.OPEN: ("K pool", "V pool")}
)


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
    """Where prefill may write: decode's transfer endpoint and the memory it announced.

    ``channel`` SEALED: ``bases`` is the landing slots' base; page ``p``'s sealed chunk goes to
    the slot at ``base + p * slot size`` (``backend.disagg.channel``), registered only while the
    handoff that holds page ``p`` runs. OPEN: ``bases`` are the K and V pools' base addresses.
    ``instance_id`` names one decode process lifetime: messages for another instance (a decode
    that restarted) are refused. ``max_batch_pages`` is the transfer-batch limit decode's drain
    bound is derived from; prefill must never have more pages than that in flight. Prefill writes
    only to a target exactly as decode announced it (``DecodeAnnouncement``).
    """

    endpoint: str
    instance_id: str
    channel: KvChannel
    bases: tuple[int, ...]
    layout: KvLayout
    max_batch_pages: int

    def __post_init__(self) -> None:
        names = BASES[self.channel]
        if len(self.bases) != len(names) or any(base < 1 for base in self.bases):
            raise ValueError(f"the {self.channel.value} channel has bases: {', '.join(names)}")


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
    seal_key: bytes | None = field(default=None, repr=False)  # SEALED: this handoff's key

    def __post_init__(self) -> None:
        sealed = self.target.channel is KvChannel.SEALED
        if sealed != (self.seal_key is not None):
            raise ValueError("a seal key comes with a sealed target, and only with one")
        if self.seal_key is not None and len(self.seal_key) != SEAL_KEY_BYTES:
            raise ValueError(f"the seal key is {SEAL_KEY_BYTES} bytes")
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


@dataclass(frozen=True, slots=True)
class DecodeAnnouncement:
    """Decode tells prefill where it may write: its exact transfer target (prefill echoes it)."""

    protocol_version: int
    target: TransferTarget


Message = PrefillRequest | PrefillResult | AbortRequest | AbortAck | DecodeAnnouncement


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
    if isinstance(value, bytes):
        return value.hex()
    if hasattr(value, "__dataclass_fields__"):
        return {n: _plain(getattr(value, n)) for n in value.__dataclass_fields__}
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value


def _grant(payload: object) -> PageGrant:
    r = Reader("PageGrant", payload, keys_of(PageGrant))
    return build("PageGrant", lambda: PageGrant(r.integer("page_id"), r.integer("generation", 1)))


def _range(payload: object) -> TokenRange | None:
    if payload is None:
        return None
    r = Reader("TokenRange", payload, keys_of(TokenRange))
    return build("TokenRange", lambda: TokenRange(r.integer("start"), r.integer("end")))


def _error(payload: object) -> ErrorInfo | None:
    if payload is None:
        return None
    r = Reader("ErrorInfo", payload, keys_of(ErrorInfo))
    return ErrorInfo(r.text("code"), r.integer("http_status", 100), r.text("message"))


def _layout(payload: object) -> KvLayout:
    r = Reader("KvLayout", payload, keys_of(KvLayout))
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
    r = Reader("TransferTarget", payload, keys_of(TransferTarget))
    channel = r.text("channel")
    if channel not in KvChannel._value2member_map_:
        raise MalformedMessage("TransferTarget", f"unknown channel {channel!r}")
    return build(
        "TransferTarget",
        lambda: TransferTarget(
            r.text("endpoint"),
            r.text("instance_id"),
            KvChannel(channel),
            r.integers("bases"),
            _layout(r.sub("layout")),
            r.integer("max_batch_pages", 1),
        ),
    )


def _seal_key(text: str | None) -> bytes | None:
    if text is None:
        return None
    try:
        key = bytes.fromhex(text)
    except ValueError as exc:
        raise MalformedMessage("PrefillRequest", "seal_key must be hex") from exc
    if len(key) != SEAL_KEY_BYTES:
        raise MalformedMessage("PrefillRequest", f"seal_key must be {SEAL_KEY_BYTES} bytes")
    return key


def _sampling(payload: object) -> SamplingSpec:
    r = Reader("SamplingSpec", payload, keys_of(SamplingSpec))
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
    r = Reader("GrammarSpec", payload, keys_of(GrammarSpec))
    kind, schema = r.sub("kind"), r.sub("schema")
    if not isinstance(kind, str) or kind not in tuple(GrammarKind):
        raise MalformedMessage("GrammarSpec", f"unknown kind {str(kind)[:32]!r}")
    if schema is not None and (not isinstance(schema, str) or len(schema) > MAX_GRAMMAR_CHARS):
        raise MalformedMessage("GrammarSpec", "schema must be a string of JSON or null")
    return build("GrammarSpec", lambda: GrammarSpec(GrammarKind(kind), schema, r.flag("strict")))


def _logprobs(payload: object) -> TokenLogprobs | None:
    if payload is None:
        return None
    r = Reader("TokenLogprobs", payload, keys_of(TokenLogprobs))
    return TokenLogprobs(r.number("logprob"), r.pairs("top"))


def prefill_request_from_wire(payload: object, local: int = PROTOCOL_VERSION) -> PrefillRequest:
    check_version(payload, "prefill request", local)
    r = Reader("PrefillRequest", payload, keys_of(PrefillRequest))
    return build(
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
            _seal_key(r.opt_text("seal_key")),
        ),
    )


def prefill_result_from_wire(payload: object, local: int = PROTOCOL_VERSION) -> PrefillResult:
    check_version(payload, "prefill result", local)
    r = Reader("PrefillResult", payload, keys_of(PrefillResult))
    outcome = r.text("outcome")
    if outcome not in HandoffOutcome._value2member_map_:
        raise MalformedMessage("PrefillResult", f"unknown outcome {outcome!r}")
    return build(
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
    r = Reader("AbortRequest", payload, keys_of(AbortRequest))
    return AbortRequest(r.integer("protocol_version"), r.text("request_id"), r.text("instance_id"))


def abort_ack_from_wire(payload: object, local: int = PROTOCOL_VERSION) -> AbortAck:
    check_version(payload, "abort ack", local)
    r = Reader("AbortAck", payload, keys_of(AbortAck))
    return AbortAck(
        r.integer("protocol_version"),
        r.text("request_id"),
        r.text("instance_id"),
        r.flag("quiesced"),
        r.text("state"),
    )


def decode_announcement_from_wire(
    payload: object, local: int = PROTOCOL_VERSION
) -> DecodeAnnouncement:
    check_version(payload, "decode announcement", local)
    r = Reader("DecodeAnnouncement", payload, keys_of(DecodeAnnouncement))
    return DecodeAnnouncement(r.integer("protocol_version"), _target(r.sub("target")))
