"""Token ids -> text deltas, with stop sequences, for one response.

Lifecycle per response: ``push(token_id)`` for every sampled token -> deltas that are safe to send
-> ``finish()`` for the held-back tail. Two things are held back: bytes that do not yet form a
complete UTF-8 character (the tokenizer's stream decoder holds those), and the last
``len(longest stop) - 1`` characters, which might still become a stop sequence (the stop sequence
itself is never sent, as OpenAI does).

``kept``: special tokens whose text is kept (decoding drops special tokens): the tokens a
checkpoint's tool-call format starts calls with (``[TOOL_CALLS]``, ``<|python_tag|>``), which the
tool-call parser must see.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from backend.model.tokenizer import StreamDecoder


@dataclass(frozen=True, slots=True)
class Delta:
    text: str
    stopped: bool


@dataclass(slots=True)
class TextStream:
    decoder: StreamDecoder
    stops: Sequence[str] = ()
    kept: Mapping[int, str] = field(default_factory=dict)
    _held: str = ""
    _stopped: bool = field(default=False)

    @property
    def stopped(self) -> bool:
        return self._stopped

    def push(self, token_id: int) -> Delta:
        if self._stopped:
            return Delta("", True)
        text = self.decoder.push(token_id)
        if token_id in self.kept:
            text += self.kept[token_id]
        return self._release(self._held + text)

    def finish(self) -> str:
        """The tail held back for stop matching (empty once a stop sequence was seen)."""
        if self._stopped:
            return ""
        delta = self._release(self._held + self.decoder.flush(), final=True)
        return delta.text

    def _release(self, text: str, *, final: bool = False) -> Delta:
        hits = [at for at in (text.find(stop) for stop in self.stops) if at >= 0]
        if hits:
            self._stopped, self._held = True, ""
            return Delta(text[: min(hits)], True)
        keep = 0 if final else max((len(s) for s in self.stops), default=1) - 1
        if keep <= 0:
            self._held = ""
            return Delta(text, False)
        self._held = text[-keep:]
        return Delta(text[:-keep], False)
