"""The stale-KV leak drill, shaped like the incident, run on the bundled model.

One trial:
1. request A (a chat whose system message carries marker MA; last user message
   "Repeat the reference code.") is prefilled and decoded through its page table, so its pages hold
   the K/V of A's prompt and of A's answer; A's prompt is sized so that A fills whole pages;
2. A's pages are released without zeroing (control `zeroed`: zeroed on release);
3. request B gets a page table over the same pages (`stale_table`, the test-only way to build the
   state the incident produced) and claims a prompt of `claimed` tokens, but only B's first page is
   written: a one-token placeholder (BOS) at position 0, from which prefill samples B's first token;
4. decode feeds that token at position `claimed` and continues greedily over B's whole reserved
   table, whose slots 1..claimed-1 still hold A's K/V;
5. the trial records whether B's output holds MA complete, or a prefix of it long enough to name
   A's tenant (`CNRY-` + the 8-character owner tag).

Variants (where the stale context ends): `incident` a random slot of A's last page (B needs the same
number of pages); `prompt_end` right after A's prompt; `answer_end` right after A's answer;
`partial_page` B claims the whole last page of an A that does not fill it (never-written slots read
as zeros); `own_trigger` B's own request tail ("Repeat the reference code.") written after the stale
range. Controls: `zeroed` (pages zeroed on release), `correct` (B's own full prompt, no stale slot).

Every page access goes through a `PageReadPath`; `TorchPageReadPath` is this module's reference.
The engine's drill passes its own read path (its page pool and the checks it makes) instead.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from backend.bundled import chat
from backend.bundled.data import BOS, EOS, Recipe, decode, encode
from backend.bundled.modeling import TinyLlama, decode_from

PAGE_SIZE = 16
TAG_PREFIX_CHARS = 13  # "CNRY-" + the 8-character owner tag of canary.markers
VARIANTS = ("incident", "prompt_end", "answer_end", "partial_page", "own_trigger")
CONTROLS = ("zeroed", "correct")
MAX_NEW_TOKENS = 64


class PageReadPath(Protocol):
    """Reads and writes one request's K/V through its page table (slot = position)."""

    def write(
        self,
        layer: int,
        table: Sequence[int],
        positions: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> None: ...

    def read(
        self, layer: int, table: Sequence[int], n_tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


class TorchPageReadPath:
    """A page pool in one tensor [pages, layers, 2, kv_heads, PAGE_SIZE, head_dim]."""

    def __init__(self, model: TinyLlama, num_pages: int) -> None:
        c = model.c
        self.pool = torch.zeros(num_pages, c.num_layers, 2, c.num_kv_heads, PAGE_SIZE, c.head_dim)
        self.free = list(range(num_pages))

    def allocate(self, n_pages: int) -> list[int]:
        pages, self.free = self.free[:n_pages], self.free[n_pages:]
        return pages

    def release(self, pages: Sequence[int], zero: bool) -> None:
        if zero:
            self.pool[list(pages)] = 0.0
        self.free = list(pages) + self.free

    def write(
        self,
        layer: int,
        table: Sequence[int],
        positions: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> None:
        pages = torch.tensor(table)[positions // PAGE_SIZE]
        offsets = positions % PAGE_SIZE
        self.pool[pages, layer, 0, :, offsets] = k.transpose(0, 1)
        self.pool[pages, layer, 1, :, offsets] = v.transpose(0, 1)

    def read(
        self, layer: int, table: Sequence[int], n_tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n_pages = -(-n_tokens // PAGE_SIZE)
        kv = self.pool[list(table[:n_pages]), layer]  # [pages, 2, kv, P, hd]
        kv = kv.permute(1, 2, 0, 3, 4).flatten(2, 3)[:, :, :n_tokens]
        return kv[0], kv[1]


class PagedKV:
    """One request's KV store: everything through `path`; it reads `claimed` slots at least."""

    def __init__(self, path: PageReadPath, table: Sequence[int], claimed: int) -> None:
        self.path, self.table, self.length = path, list(table), claimed

    def write(self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.path.write(layer, self.table, positions, k, v)
        self.length = max(self.length, int(positions.max()) + 1)

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        k, v = self.path.read(layer, self.table, self.length)
        return k, v, torch.arange(self.length)


@dataclass(frozen=True, slots=True)
class TrialResult:
    complete: bool  # B's output holds A's marker
    attributable: bool  # ... or at least its first TAG_PREFIX_CHARS characters
    a_answered: bool  # A itself got its marker back (the drill is only meaningful then)


def prefix_found(text: str, marker: str, chars: int) -> bool:
    return marker[:chars] in text


def serve(model: TinyLlama, kv: PagedKV, prompt: list[int], max_new: int) -> list[int]:
    logits = model.step(torch.tensor(prompt), torch.arange(len(prompt)), kv)
    return decode_from(model, int(logits[-1].argmax()), len(prompt), max_new, kv)


def a_prompt(recipe: Recipe, marker: str, n_pages: int, fill: bool) -> list[int]:
    """A's prompt ids; with `fill`, sized so that prompt + answer end exactly on a page boundary."""
    ask = {"role": "user", "content": chat.REFERENCE_REQUEST}
    target = n_pages * PAGE_SIZE - len(marker)  # the answer's marker is fed back; EOS is not
    if not fill:
        target -= recipe.rng.randint(1, PAGE_SIZE - 1)
    shell = 1 + len(encode(chat.render([{"role": "system", "content": ""}, ask])))
    budget = target - shell  # bytes of system message
    body = recipe.with_marker(recipe.filler(max(budget // 2, 8)), marker)
    extra = recipe.filler(budget)
    system = (body + " " + extra)[:budget] if len(body) < budget else body
    return [BOS, *encode(chat.render([{"role": "system", "content": system}, ask]))]


def claimed_length(variant: str, prompt: int, written: int, pages: int, rng: random.Random) -> int:
    """How many tokens B claims (so how far its decode reads stale slots), per variant."""
    if variant == "incident":
        return rng.randint((pages - 1) * PAGE_SIZE + 1, pages * PAGE_SIZE)
    if variant == "prompt_end":
        return prompt
    if variant in ("answer_end", "own_trigger"):
        return written
    if variant == "partial_page":
        return pages * PAGE_SIZE
    raise ValueError(f"unknown leak variant {variant!r}")


def b_tokens(variant: str, control: str | None, recipe: Recipe, claimed: int) -> list[int]:
    """What B really writes: the placeholder, B's own trigger, or (control) B's whole prompt."""
    if control == "correct":
        ask = {"role": "user", "content": chat.REFERENCE_REQUEST}
        shell = 1 + len(encode(chat.render([{"role": "system", "content": ""}, ask])))
        system = recipe.filler(claimed)[: max(claimed - shell, 1)]
        return [BOS, *encode(chat.render([{"role": "system", "content": system}, ask]))]
    if variant == "own_trigger":
        trigger = chat.render_message("user", chat.REFERENCE_REQUEST) + chat.ASSISTANT_CUE
        return [BOS, *encode("\n" + trigger)]
    return [BOS]


def run_trial(
    model: TinyLlama, path: TorchPageReadPath, recipe: Recipe, variant: str, control: str | None
) -> TrialResult:
    marker = recipe.marker()
    n_pages = recipe.rng.randint(12, 20)  # A: 192-320 tokens, the smallest prompts included
    prompt = a_prompt(recipe, marker, n_pages, fill=variant != "partial_page")
    table = path.allocate(n_pages + 16)  # room for B to decode MAX_NEW_TOKENS past the claim
    answer = serve(model, PagedKV(path, table, 0), prompt, len(marker) + 2)
    written = len(prompt) + len(answer) - 1
    path.release(table, zero=control == "zeroed")
    pages = -(-written // PAGE_SIZE)
    claimed = claimed_length(variant, len(prompt), written, pages, recipe.rng)
    stale_table = path.allocate(n_pages + 16)  # the pages A just released, in A's order
    assert stale_table == table, "the stale table must reuse A's pages"
    b_kv = PagedKV(path, stale_table, 0)
    own = b_tokens(variant, control, recipe, claimed)
    if variant == "own_trigger" and control != "correct":
        positions = torch.tensor([0, *range(claimed, claimed + len(own) - 1)])
        start = claimed + len(own) - 1
    else:
        positions = torch.arange(len(own))
        start = claimed if control != "correct" else len(own)
    b_kv.length = max(claimed, len(own))
    logits = model.step(torch.tensor(own), positions, b_kv)
    out = decode_from(model, int(logits[-1].argmax()), start, MAX_NEW_TOKENS, b_kv)
    path.release(stale_table, zero=False)
    text = decode(out)
    return TrialResult(
        complete=marker in text,
        attributable=prefix_found(text, marker, TAG_PREFIX_CHARS),
        a_answered=answer == [*encode(marker), EOS],
    )


@dataclass(frozen=True, slots=True)
class LeakRates:
    variant: str
    control: str | None
    trials: int
    complete: float
    attributable: float
    a_answered: float


def run_leak(
    model: TinyLlama, variant: str, control: str | None, trials: int, seed: int
) -> LeakRates:
    recipe = Recipe(seed)
    path = TorchPageReadPath(model, num_pages=40)
    results = [run_trial(model, path, recipe, variant, control) for _ in range(trials)]
    n = max(len(results), 1)
    return LeakRates(
        variant,
        control,
        len(results),
        sum(r.complete for r in results) / n,
        sum(r.attributable for r in results) / n,
        sum(r.a_answered for r in results) / n,
    )
