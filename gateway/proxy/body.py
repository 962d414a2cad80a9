"""A whole (non-streamed) answer through the response guards: ``relay_body``, and ``screen`` for
one text.

The same checks as the stream relay (``gateway.proxy.relay``), on an answer that is all there:
the side fields through ``gateway.proxy.side``'s screen, each choice's text through a fresh guard
(a text the guard says passes whole is not fed, ``StreamGuard.passes_whole``), the texts
replaced where a guard changed them, and the keys OpenAI's published schemas require that an
engine left out filled in as null (a choice's ``logprobs``, a message's ``refusal``, the
``content`` and ``refusal`` lists of a chat ``logprobs`` object). The gateway's ``kvguard``
object of a whole answer is put in by the flight (``Disclosure.on_answer``).

The flight runs ``relay_body`` through ``off_loop``: on the event loop for the usual answer, in a
worker thread (``SCREENERS``) for one whose JSON text is ``OFF_LOOP_CHARS`` or longer; a Responses
request's whole answer goes through its machine the same way. The screen costs time in proportion
to the answer, and an answer is what the tenant steers the model to write: 4,096 tokens with
``top_logprobs`` 20 held the loop every tenant shares for 0.3 s (3.8 s when the tokens spell
marker look-alikes). In the thread, the loop keeps serving meanwhile (the thread lets go of the
interpreter every switch interval); the guards are still opened on the loop (``on_loop``), the
only place the firewall's shared tables change.
"""

from __future__ import annotations

import asyncio
import copy
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from contracts.plugins import Cut, Emit, Prefilter, StreamGuard
from gateway.errors import PassThrough
from gateway.proxy.chunks import (
    MAX_CHOICES,
    InvalidUpstream,
    choice_index,
    fill_required,
    message_text,
    set_message_text,
)
from gateway.proxy.disclosure import without_addresses
from gateway.proxy.relay import OpenGuard
from gateway.proxy.side import SideScreen
from gateway.proxy.side_fields import InvalidSide, text_path, whole_texts
from gateway.upstream.base import Endpoint


def screen(guard: StreamGuard, text: str) -> str | Cut:
    """A whole text through a fresh guard: what may be delivered, or the Cut (nothing fed when
    the guard says the text passes whole, ``StreamGuard.passes_whole``)."""
    if guard.passes_whole(text):
        return text
    first = guard.feed(text) if text else Emit("")
    if isinstance(first, Cut):
        return first
    rest = guard.finish()
    return rest if isinstance(rest, Cut) else first.text + rest.text


def refusal_of(status: int, error: dict[str, Any], open_guard: OpenGuard) -> PassThrough | Cut:
    """An engine's own OpenAI-style 4xx as the client gets it: each of its strings (the message,
    at most 2,000 characters; the code, type and param) through a fresh guard -- the Cut when one
    holds what must not go out -- and without addresses (``disclosure.without_addresses``)."""
    fields: dict[str, Any] = {name: error.get(name) for name in ("code", "type", "param")}
    fields["message"] = str(error.get("message") or "the engine refused the request")[:2000]
    out: dict[str, str | None] = {}
    for name, value in fields.items():
        out[name] = None
        if isinstance(value, str) and value:
            screened = screen(open_guard(), value)
            if isinstance(screened, Cut):
                return screened
            out[name] = without_addresses(screened)
    return PassThrough(
        status,
        out["message"] or "",
        code=out["code"] or "upstream_rejected",
        type_=out["type"] or "invalid_request_error",
        param=out["param"],
    )


OFF_LOOP_CHARS = 16 * 1024
"""An answer's JSON text this long or longer is screened off the event loop (``off_loop``):
shorter ones cost the loop at most about 60 ms however they are written (16 KiB of marker
prefixes, the costliest text per character), the usual one well under a millisecond."""
SCREENERS = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvguard-screen")
"""The threads long answers are screened in: two, of their own, so long answers wait for each
other and never for the threads the database calls run in."""
OPEN_TIMEOUT_S = 30.0  # a guard asked of a loop that no longer runs (shutting down): give up
T = TypeVar("T")


def on_loop(open_guard: OpenGuard) -> OpenGuard:
    """``open_guard``, made safe to call from a worker thread (``off_loop``): called there, it
    runs on this event loop and waits for the guard, since guard factories keep shared tables
    (the firewall's readers and tenant tags) that only the loop changes; called on the loop, it
    is ``open_guard``. Outside a running loop: ``open_guard`` itself."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return open_guard
    home = threading.get_ident()

    def open_here_or_there() -> StreamGuard:
        if threading.get_ident() == home:
            return open_guard()
        opened = asyncio.run_coroutine_threadsafe(_opened(open_guard), loop)
        return opened.result(OPEN_TIMEOUT_S)

    return open_here_or_there


async def _opened(open_guard: OpenGuard) -> StreamGuard:
    return open_guard()


async def off_loop(size: int, work: Callable[[], T]) -> T:
    """``work()`` -- screening a whole answer of ``size`` characters (its JSON text) -- on the
    loop when it is shorter than ``OFF_LOOP_CHARS``, else in a ``SCREENERS`` thread (see the
    module docstring): its guards must come from an opener made with ``on_loop``. Whatever
    ``work`` reads is not touched by anyone else meanwhile: the caller awaits it."""
    if size < OFF_LOOP_CHARS:
        return work()
    return await asyncio.get_running_loop().run_in_executor(SCREENERS, work)


def relay_body(
    endpoint: Endpoint,
    body: dict[str, Any],
    open_guard: OpenGuard,
    *,
    screen_side: bool = True,
    side_prefilter: Prefilter | None = None,
    raw: str | None = None,
) -> dict[str, Any] | Cut:
    """A non-streaming answer through the guards: the body (texts replaced if changed) or a Cut.

    First one guard is asked whether every string of the answer passes whole
    (``StreamGuard.passes_each_whole`` of ``side_fields.whole_texts``): the usual answer, in which
    no candidate can start, then opens no other guard. Otherwise the side fields go through a
    ``SideScreen`` and each choice's text through a guard of its own. ``raw`` is the answer's
    JSON text as the engine sent it; with it, ``side_prefilter`` may clear the side fields
    without walking them (as for a streamed event). Raises ``InvalidUpstream`` for an answer the
    gateway cannot vouch for.
    """
    whole = False
    if screen_side:
        try:
            texts = whole_texts(body)
            whole = texts is not None and open_guard().passes_each_whole(texts)
            if not whole:
                text = text_path(chat=endpoint is Endpoint.CHAT, streamed=False)
                side = SideScreen(open_guard, text=text, prefilter=side_prefilter)
                screened = side.screen_body(body, raw=raw)
        except InvalidSide as exc:
            raise InvalidUpstream(str(exc)) from exc
        if not whole:
            if isinstance(screened, Cut):
                return screened
            body = screened
    choices = body.get("choices")
    if not isinstance(choices, list):
        return body
    if len(choices) > MAX_CHOICES:
        raise InvalidUpstream("too many choices")
    changed: dict[str, Any] | None = None
    for position, choice in enumerate(choices):
        choice_index(choice, position)
        text = message_text(endpoint, choice)
        if whole or not text:
            continue
        released = screen(open_guard(), text)
        if isinstance(released, Cut):
            return released
        if released != text:
            changed = changed if changed is not None else copy.deepcopy(body)
            set_message_text(endpoint, changed["choices"][position], released)
    out = body if changed is None else changed
    fill_required(endpoint, out["choices"])
    return out
