"""Which strings of an engine's answer are *side* fields, under which field key, and where the
rewritable ones are: the walk the side screen (``gateway.proxy.side``) reads an event by. Pure.

An answer's text (each choice's ``delta.content``, ``message.content`` or ``text``: ``text_path``
for the relay's shape) is not a side field; every other string an engine sends is: ids, names,
finish reasons, error messages, usage, extension fields, logprobs tokens. A field's *key* is its
path with list positions folded into ``*`` (``choices.*.logprobs.content.*.token``: one token
sequence), except in the lists whose elements are separate streams (``IDENTITY_LISTS``): each
choice, each tool call (by its ``index``, else its position) and each rank of a chat token's
``top_logprobs`` has its own key, so choices and tool calls that interleave across events (n > 1,
parallel tool calls) are each read in order, never spliced into one another. All keys of all
objects form one more stream (``KEYS_PATH``), except the tokens the completions API writes as keys
(``TOKEN_MAP_PATH``: one stream per choice and rank).

The side fields that carry text the model wrote (``REWRITE_PATHS``: reasoning, refusal, tool-call
arguments, logprobs tokens) are rewritable: ``rewrite_sites`` finds them with their locations,
``set_at`` puts a screened text back (a logprobs token's ``bytes`` follow it). An answer with more
than ``MAX_PATHS`` field keys is refused (``InvalidSide``) rather than given unbounded guards.
"""

from __future__ import annotations

from typing import Any

import orjson

MAX_PATHS = 256  # 16 choices x a dozen per-choice fields, with room
KEYS_PATH = "<keys>"
# Lists whose elements are separate streams: choices, tool calls (by ``index``), the ranks of a
# chat token's top_logprobs (by position). Every other list is a sequence (tokens, positions).
IDENTITY_LISTS = frozenset(
    ["choices"]
    + [f"choices.*.{m}.tool_calls" for m in ("delta", "message")]
    + [f"choices.*.logprobs.{part}.*.top_logprobs" for part in ("content", "refusal")]
)
# The completions API's top_logprobs: per position a {token: logprob} map, most likely first. Its
# keys are model text: each rank's keys form one stream per choice, not part of KEYS_PATH, where
# every other key of every event would split them.
TOKEN_MAP_PATH = "choices.*.logprobs.top_logprobs.*"
TEXT_PATHS = frozenset({"choices.*.delta.content", "choices.*.message.content", "choices.*.text"})
"""Where an answer of some shape holds its text. Only the one the relay screens as text
(``text_path``) is left out of the side fields: another shape's text in an answer is a side field
like any other string an engine sends."""
_MODEL_TEXT = (
    "{m}.reasoning_content",
    "{m}.reasoning",
    "{m}.refusal",
    "{m}.tool_calls.*.function.arguments",
    "{m}.function_call.arguments",
)
_LOGPROB_TOKENS = (
    "logprobs.content.*.token",
    "logprobs.content.*.top_logprobs.*.token",
    "logprobs.refusal.*.token",
    "logprobs.refusal.*.top_logprobs.*.token",
    "logprobs.tokens.*",
)
REWRITE_PATHS = frozenset(
    [f"choices.*.{p.format(m=m)}" for p in _MODEL_TEXT for m in ("delta", "message")]
    + [f"choices.*.{p}" for p in _LOGPROB_TOKENS]
)
EMBEDDING_PATH = "data.*.embedding"
"""An embeddings answer's vector (numbers, or base64 of them): nothing a model wrote, not
screened (a side screen of that answer is given it as its text path)."""
# per text path: the paths whose strings are not cut-only side fields (the text, rewritten ones)
_NOT_CUT_ONLY = {path: REWRITE_PATHS | {path} for path in TEXT_PATHS | {EMBEDDING_PATH}}
# Every rewritable path has one of these keys: an event whose JSON text has none of them (and no
# escape that could spell one) is not walked a second time.
REWRITE_KEYS = ("reasoning", "refusal", "arguments", "logprobs")

Location = tuple[str | int, ...]  # dict keys and list positions from the event's root


class InvalidSide(ValueError):
    """Too many distinct field paths in one response."""


def text_path(*, chat: bool, streamed: bool) -> str:
    """Where the relay of this shape of answer finds each choice's text
    (``gateway.proxy.chunks.chunk_text`` and ``message_text``)."""
    if not chat:
        return "choices.*.text"
    return "choices.*.delta.content" if streamed else "choices.*.message.content"


def side_fields(obj: dict[str, Any], text: str) -> dict[str, list[str]]:
    """field key -> the strings under that key, in document order, leaving out the choices' texts
    (at ``text``, a ``text_path``) and the rewritable side fields (``rewrite_sites``)."""
    return _Walk(_NOT_CUT_ONLY[text]).of(obj).fields


def whole_texts(obj: dict[str, Any]) -> list[str] | None:
    """What one check of a whole answer reads (``relay_body``): every field key's strings joined
    in document order, as each key's guard would read them in turn -- each choice's text, each
    side field, each rewritable field -- and each string of a rewritable field with more than one
    also on its own (each is delivered in its place, so none may end as a marker's prefix begins).
    None for an answer with more field keys than ``MAX_PATHS`` (the guards refuse it)."""
    rewritable: set[str] = set()
    fields = _Walk(frozenset(), rewritable=rewritable).of(obj).fields
    if len(fields) > MAX_PATHS:
        return None
    texts = ["".join(values) for values in fields.values()]
    for key in rewritable:
        if len(values := fields[key]) > 1:
            texts += values
    return texts


class _Walk:
    """The strings of an answer by field key, leaving out those at the ``skip`` paths; the keys of
    rewritable strings are noted in ``rewritable`` when it is given."""

    __slots__ = ("fields", "rewritable", "skip")

    def __init__(self, skip: frozenset[str], *, rewritable: set[str] | None = None) -> None:
        self.fields: dict[str, list[str]] = {KEYS_PATH: []}
        self.skip = skip
        self.rewritable = rewritable

    def of(self, obj: dict[str, Any]) -> _Walk:
        try:
            self._dict(obj, "", "")
        except RecursionError as exc:
            raise InvalidSide("an answer nested too deeply") from exc
        return self

    def _dict(self, value: dict[str, Any], path: str, key: str) -> None:
        fields = self.fields
        if path == TOKEN_MAP_PATH:  # each rank of the map is a stream of its own, like its values
            for rank, token in enumerate(value):
                fields.setdefault(f"{key}.<rank {rank}>", []).append(token)
        else:
            fields[KEYS_PATH].extend(value)
        for name, item in value.items():
            self._item(item, f"{path}.{name}" if path else name, f"{key}.{name}" if key else name)

    def _list(self, value: list[Any], path: str, key: str) -> None:
        if all(type(item) in _NUMBERS for item in value):  # a vector, token bytes: no string
            return
        identity = path in IDENTITY_LISTS
        for position, item in enumerate(value):
            self._item(
                item, f"{path}.*", f"{key}.{_identity(item, position)}" if identity else f"{key}.*"
            )

    def _item(self, item: Any, path: str, key: str) -> None:
        if isinstance(item, str):
            if path not in self.skip:
                self.fields.setdefault(key, []).append(item)
                if self.rewritable is not None and path in REWRITE_PATHS:
                    self.rewritable.add(key)
        elif isinstance(item, dict):
            self._dict(item, path, key)
        elif isinstance(item, list):
            self._list(item, path, key)


_NUMBERS = (int, float)


def _identity(item: Any, position: int) -> int:
    """Which stream an element of an identity list belongs to: its ``index``, else its place."""
    index = item.get("index") if isinstance(item, dict) else None
    return index if isinstance(index, int) and not isinstance(index, bool) else position


Site = tuple[str, Location, str]  # (field key, location, value)


def rewrite_sites(obj: dict[str, Any]) -> list[Site]:
    """(field key, location, value) of every rewritable string, in document order."""
    sites: list[Site] = []
    choices = obj.get("choices")
    if isinstance(choices, list):
        try:
            for position, choice in enumerate(choices):
                key = f"choices.{_identity(choice, position)}"
                _sites(choice, "choices.*", key, ("choices", position), sites)
        except RecursionError as exc:
            raise InvalidSide("an answer nested too deeply") from exc
    return sites


def _sites(value: Any, path: str, key: str, at: Location, out: list[Site]) -> None:
    if isinstance(value, dict):
        for name, item in value.items():
            _sites(item, f"{path}.{name}", f"{key}.{name}", (*at, name), out)
    elif isinstance(value, list):
        identity = path in IDENTITY_LISTS
        for position, item in enumerate(value):
            inner_key = f"{key}.{_identity(item, position)}" if identity else f"{key}.*"
            _sites(item, f"{path}.*", inner_key, (*at, position), out)
    elif isinstance(value, str) and path in REWRITE_PATHS:
        out.append((key, at, value))


def identities_at(obj: Any, location: Location) -> tuple[int | None, ...]:
    found: list[int | None] = []
    for step in location:
        obj = obj[step]
        if isinstance(step, int):
            index = obj.get("index") if isinstance(obj, dict) else None
            found.append(index if isinstance(index, int) else None)
    return tuple(found)


def skeleton(obj: dict[str, Any], *, chat: bool) -> bytes | None:
    """``obj`` serialised with its one choice's text (a chat delta's ``content``, a completion
    choice's ``text``) empty: what ``SideScreen.feed`` compares. None for an event without
    exactly one choice with a text, or one orjson cannot write (an integer past 64 bits)."""
    choices = obj.get("choices")
    if type(choices) is not list or len(choices) != 1 or type(choices[0]) is not dict:
        return None
    owner = choices[0].get("delta") if chat else choices[0]
    name = "content" if chat else "text"
    if type(owner) is not dict or type(text := owner.get(name)) is not str:
        return None
    owner[name] = ""
    try:
        return orjson.dumps(obj)
    except orjson.JSONEncodeError:
        return None
    finally:
        owner[name] = text


def set_at(obj: Any, location: Location, text: str) -> None:
    """Put ``text`` at ``location``; a logprobs token's ``bytes`` follow its new text."""
    container = obj
    for step in location[:-1]:
        container = container[step]
    last = location[-1]
    container[last] = text
    if last == "token" and isinstance(container, dict) and isinstance(container.get("bytes"), list):
        container["bytes"] = list(text.encode())


def append_at(obj: Any, location: Location, text: str) -> None:
    value = obj
    for step in location:
        value = value[step]
    set_at(obj, location, value + text)
