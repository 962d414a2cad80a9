"""The stale-KV leak drill, shaped like the incident, run on the engine's own read path.

Everything goes through the serving engine's parts, not a copy of them: the page pool
(`backend.core.pages.PagePool`: owners, generations, FIFO reuse, zero-on-free gating), the paged
KV cache (`backend.model.kv_cache.KVCache`), the engine's Llama (`backend.model.llama`) and its
paged attention over block tables (`AttentionMetadata`). One trial:

1. request A (a chat whose system message carries marker MA; last user message
   "Repeat the reference code.") is allocated pages by the pool, prefilled and decoded through its
   page table, so its pages hold the K/V of A's prompt and of A's answer; A's prompt is sized so
   that A fills whole pages;
2. A's pages are freed without zeroing (control `zeroed`: the pool runs with zero_on_free, so they
   are zeroed and confirmed before anyone may allocate them);
3. request B is allocated pages by the same pool. The test-only part is only the pool's size: it
   holds exactly A's table, so FIFO reuse hands B A's pages in A's order (the state the incident
   produced). B claims a prompt of `claimed` tokens, but only B's first page is written: a
   one-token placeholder (BOS) at position 0, from which B's first token is sampled;
4. decode feeds that token at position `claimed` and continues greedily over B's whole reserved
   table, whose slots 1..claimed-1 still hold A's K/V. Every forward first passes the pool's
   read-path check (`verify`: owner and generation): B owns its pages legitimately, which is why
   that check alone could not stop the incident;
5. the trial records whether B's output holds MA complete, or a prefix of it long enough to name
   A's tenant (`CNRY-` + the 8-character owner tag).

Variants (where the stale context ends): `incident` a random slot of A's last page (B needs the same
number of pages); `prompt_end` right after A's prompt; `answer_end` right after A's answer;
`partial_page` B claims the whole last page of an A that does not fill it (never-written slots read
as zeros); `own_trigger` B's own request tail ("Repeat the reference code.") written after the stale
range; `shifted` the disaggregated incident's layout: B's table starts with never-written pages
(B's placeholder page among them) and A's pages follow, so A's K/V (computed at A's positions
0..) sits at B's positions F*16.., and B decodes at positions that A's K/V never had. Controls:
`zeroed` (pages zeroed on free), `correct` (B's own full prompt, no stale slot).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from backend.bundled import chat
from backend.bundled.data import BOS, EOS, Recipe, decode, encode
from backend.core.pages import Owner, PagePool, PageRef
from backend.kernels.metadata import AttentionMetadata
from backend.model.kv_cache import KVCache
from backend.model.llama import LlamaModel, load_model

PAGE_SIZE = 16
TAG_PREFIX_CHARS = 13  # "CNRY-" + the 8-character owner tag of canary.markers
VARIANTS = ("incident", "prompt_end", "answer_end", "partial_page", "own_trigger", "shifted")
CONTROLS = ("zeroed", "correct")
MAX_NEW_TOKENS = 64
ROOM_PAGES = 16  # beyond A's pages: room for B to decode MAX_NEW_TOKENS past its claim


def load_engine_model(model_dir: Path) -> LlamaModel:
    """The checkpoint as the serving engine loads it (fp32, CPU)."""
    model, _, _ = load_model(model_dir, "cpu", torch.float32)
    return model


class EngineKV:
    """One drill's page pool and paged KV cache; one request's forwards through its page table."""

    def __init__(self, model: LlamaModel, num_pages: int, *, zero_on_free: bool) -> None:
        self.model = model
        self.pool = PagePool(num_pages, PAGE_SIZE, zero_on_free=zero_on_free)
        self.cache: KVCache = model.new_kv_cache(num_pages, PAGE_SIZE)

    def allocate(self, owner: Owner, count: int | None = None) -> list[PageRef]:
        """`count` free pages (default: all), first-in first-out."""
        return self.pool.allocate(self.pool.free_pages if count is None else count, owner)

    def free(self, refs: Sequence[PageRef], owner: Owner) -> None:
        """Free as the engine does: with zero_on_free, zero the memory, then confirm it."""
        to_zero = self.pool.free(refs, owner)
        if to_zero:
            self.cache.zero_pages(to_zero)
            self.pool.confirm_zeroed(to_zero)
        self.pool.check_invariants()

    def forward(self, refs: Sequence[PageRef], owner: Owner, tokens: list[int], start: int) -> int:
        """Run `tokens` at positions start.. over the first pages of `refs`; greedy next token."""
        kv_len = start + len(tokens)
        table = list(refs[: -(-kv_len // PAGE_SIZE)])
        self.pool.verify(table, owner)  # the read-path check the engine core makes every step
        metadata = AttentionMetadata.build(
            query_lens=[len(tokens)],
            kv_lens=[kv_len],
            block_tables=[[ref.page_id for ref in table]],
            page_size=PAGE_SIZE,
            num_pages=self.pool.num_pages,
        )
        ids = torch.tensor(tokens, dtype=torch.int64)
        logits = self.model.forward(ids, metadata.positions(), metadata, self.cache)
        return int(logits[-1].argmax())

    def decode(
        self, refs: Sequence[PageRef], owner: Owner, first: int, position: int, max_new: int
    ) -> list[int]:
        """Generated ids starting with `first`, fed back at `position`, `position + 1`, ..."""
        out = [first]
        while len(out) < max_new and out[-1] != EOS:
            out.append(self.forward(refs, owner, [out[-1]], position))
            position += 1
        return out


@dataclass(frozen=True, slots=True)
class TrialResult:
    complete: bool  # B's output holds A's marker
    attributable: bool  # ... or at least its first TAG_PREFIX_CHARS characters
    a_answered: bool  # A itself got its marker back (the drill is only meaningful then)


def prefix_found(text: str, marker: str, chars: int) -> bool:
    return marker[:chars] in text


def serve(
    kv: EngineKV, refs: Sequence[PageRef], owner: Owner, prompt: list[int], max_new: int
) -> list[int]:
    first = kv.forward(refs, owner, prompt, 0)
    return kv.decode(refs, owner, first, len(prompt), max_new)


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
    if variant in ("answer_end", "own_trigger", "shifted"):
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
        turn = chat.render_message("user", chat.REFERENCE_REQUEST, last_user=True)
        trigger = turn + chat.ASSISTANT_CUE
        return [BOS, *encode("\n" + trigger)]
    return [BOS]


def run_trial(model: LlamaModel, recipe: Recipe, variant: str, control: str | None) -> TrialResult:
    marker = recipe.marker()
    n_pages = recipe.rng.randint(12, 20)  # A: 192-320 tokens, the smallest prompts included
    prompt = a_prompt(recipe, marker, n_pages, fill=variant != "partial_page")
    fresh = recipe.rng.randint(2, 16) if variant == "shifted" else 0
    kv = EngineKV(model, n_pages + fresh + ROOM_PAGES, zero_on_free=control == "zeroed")
    owner_a, owner_b = Owner("drill-a", "tenant-a"), Owner("drill-b", "tenant-b")
    refs_a = kv.allocate(owner_a, None if fresh == 0 else n_pages + ROOM_PAGES)
    answer = serve(kv, refs_a, owner_a, prompt, len(marker) + 2)
    written = len(prompt) + len(answer) - 1
    kv.free(refs_a, owner_a)
    pages = -(-written // PAGE_SIZE)
    claimed = fresh * PAGE_SIZE + claimed_length(variant, len(prompt), written, pages, recipe.rng)
    # FIFO reuse: never-written pages first (shifted only), then A's pages in A's order
    refs_b = kv.allocate(owner_b)
    if [r.page_id for r in refs_b[fresh:]] != [r.page_id for r in refs_a]:
        raise AssertionError("the drill needs B's table to reuse A's pages in A's order")
    own = b_tokens(variant, control, recipe, claimed)
    if control == "correct":  # B's own full prompt, nothing stale
        out = serve(kv, refs_b, owner_b, own, MAX_NEW_TOKENS)
    else:
        out = serve_stale(kv, refs_b, owner_b, own, claimed)
    kv.free(refs_b, owner_b)
    text = decode(out)
    return TrialResult(
        complete=marker in text,
        attributable=prefix_found(text, marker, TAG_PREFIX_CHARS),
        a_answered=answer == [*encode(marker), EOS],
    )


def serve_stale(
    kv: EngineKV, refs: list[PageRef], owner: Owner, own: list[int], claimed: int
) -> list[int]:
    """B as in the incident: the placeholder at 0 (own_trigger: B's tail after the claim), then
    decode from position `claimed` over the whole reserved table."""
    first = kv.forward(refs, owner, own[:1], 0)
    start = claimed
    if len(own) > 1:  # own_trigger: B's tail written right after the stale range
        first = kv.forward(refs, owner, own[1:], claimed)
        start = claimed + len(own) - 1
    return kv.decode(refs, owner, first, start, MAX_NEW_TOKENS)


@dataclass(frozen=True, slots=True)
class LeakRates:
    variant: str
    control: str | None
    trials: int
    complete: float
    attributable: float
    a_answered: float


def run_leak(
    model: LlamaModel, variant: str, control: str | None, trials: int, seed: int
) -> LeakRates:
    recipe = Recipe(seed)
    results = [run_trial(model, recipe, variant, control) for _ in range(trials)]
    n = max(len(results), 1)
    return LeakRates(
        variant,
        control,
        len(results),
        sum(r.complete for r in results) / n,
        sum(r.attributable for r in results) / n,
        sum(r.a_answered for r in results) / n,
    )
