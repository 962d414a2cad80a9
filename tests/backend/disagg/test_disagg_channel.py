"""The sealed channel's memory: exactly a handoff's slots are registered, and only until it ends;
the pages arrive sealed and open into exactly the prompt's KV (the tail of the last page zero);
bytes written into a slot by anyone else, or moved between slots, refuse the handoff; nothing
lands after the slots are withdrawn.

Both sides run here over the in-process transport, which refuses what Mooncake's server refuses.
"""

from __future__ import annotations

import ctypes

import pytest
import torch

from backend.disagg.channel import (
    Chunk,
    LandingSlots,
    Opening,
    SealedBatches,
    chunks,
    slot_bytes,
    unseal,
)
from backend.disagg.kvio import kv_digest, layout_of
from backend.disagg.protocol import KvChannel, PageGrant, TransferTarget
from backend.disagg.seal import OVERHEAD, Binding, Seal, new_key
from backend.model.kv_cache import KVCache
from backend.transport.base import Segment, TransferError
from backend.transport.inprocess import _REGISTRY, InProcessTransport

SRC_PAGES = [0, 1, 2, 5, 6]
DST_PAGES = [7, 8, 3, 4, 9]  # runs: 7-8 | 3-4 | 9
N_TOKENS = 18  # 4 full pages of 4 tokens and 2 tokens of the fifth
BINDING = Binding(3, "inst", "req.1", N_TOKENS)


def cache(pages: int, *, fill: bool) -> KVCache:
    kv = KVCache(2, pages, 4, 2, 3, torch.float32, "cpu")
    if fill:  # every slot holds something, the tails beyond the prompt included
        torch.manual_seed(pages)
        kv.k.copy_(torch.randn_like(kv.k))
        kv.v.copy_(torch.randn_like(kv.v))
    return kv


class Channel:
    """A prefill staging cache and a decode pool with its landing slots, over two transports."""

    def __init__(self, max_batch_pages: int) -> None:
        self.staging, self.pool = cache(8, fill=True), cache(12, fill=False)
        self.sender, self.receiver = InProcessTransport(), InProcessTransport()
        self.slots = LandingSlots(layout_of(self.pool), self.receiver, max_batch_pages)
        self.target = TransferTarget(
            self.receiver.endpoint,
            "inst",
            KvChannel.SEALED,
            (self.slots.base,),
            layout_of(self.pool),
            max_batch_pages,
        )
        self.grants = tuple(PageGrant(p, 1) for p in DST_PAGES)
        self.seal = Seal(new_key())

    def registered(self) -> list[tuple[int, int]]:
        """(first slot, slots) of each registered run."""
        size, base = self.slots.slot_bytes, self.slots.base
        regions = _REGISTRY[self.receiver.endpoint].items()
        return sorted(((address - base) // size, length // size) for address, length in regions)

    def send(self) -> float:
        batches = SealedBatches(
            staging=self.staging,
            source_pages=SRC_PAGES,
            target=self.target,
            grants=self.grants,
            n_tokens=N_TOKENS,
            seal=self.seal,
            binding=BINDING,
            transport=self.sender,
        )
        for batch in batches.batches():
            # one segment per chunk, from the slot of its first page on
            assert all((s.dst - self.slots.base) % self.slots.slot_bytes == 0 for s in batch)
            assert all(
                (s.length - OVERHEAD) % (self.slots.slot_bytes - OVERHEAD) == 0 for s in batch
            )
            self.sender.write(self.target.endpoint, batch)
        batches.close()
        return batches.seal_s

    def opening(self, written: int = 5) -> Opening:
        return Opening(self.seal, BINDING, self.grants, written)

    def slot(self, page_id: int) -> int:
        return self.slots.base + page_id * self.slots.slot_bytes


@pytest.mark.parametrize("batch_pages", [1, 2, 16])
def test_a_handoff_lands_sealed_and_opens_into_exactly_the_prompt(batch_pages: int) -> None:
    channel = Channel(batch_pages)
    assert channel.registered() == []  # nothing at rest
    landing = channel.slots.open(channel.grants)
    assert channel.registered() == [(3, 2), (7, 2), (9, 1)]  # this handoff's slots only
    assert channel.send() > 0
    size = slot_bytes(channel.target.layout)
    assert size == 2 * 2 * 4 * 6 * 4 + OVERHEAD
    raw = bytes(channel.slots.memory[7 * size : 9 * size])  # what a reader of the slots sees
    plain_k = channel.staging.k[0, 0].numpy().tobytes()
    assert plain_k[:24] not in raw  # not the KV in the clear
    opened = unseal(landing, channel.opening(), channel.pool)
    assert opened.problem is None and channel.registered() == []  # taken: withdrawn
    staged = kv_digest(channel.staging.k, channel.staging.v, SRC_PAGES, N_TOKENS)
    assert kv_digest(opened.k, opened.v, range(5), N_TOKENS) == staged
    opened.move_into(channel.pool, DST_PAGES)
    assert kv_digest(channel.pool.k, channel.pool.v, DST_PAGES, N_TOKENS) == staged
    for s, d in zip(SRC_PAGES[:4], DST_PAGES[:4], strict=True):
        assert torch.equal(channel.pool.k[:, d], channel.staging.k[:, s])
    # The last page: its 2 prompt slots arrive; its tail (someone else's old KV) never leaves.
    assert torch.equal(channel.pool.v[:, 9, :2], channel.staging.v[:, 6, :2])
    assert torch.count_nonzero(channel.pool.k[:, 9, 2:]) == 0
    assert torch.count_nonzero(channel.pool.v[:, 9, 2:]) == 0


def test_bytes_written_into_a_slot_by_anyone_else_refuse_the_handoff() -> None:
    channel = Channel(2)
    landing = channel.slots.open(channel.grants)
    channel.send()
    intruder = InProcessTransport()
    junk = torch.full((64,), 7, dtype=torch.uint8)  # as the attacker's own memory
    intruder.write(channel.target.endpoint, [Segment(junk.data_ptr(), channel.slot(3) + 40, 64)])
    opened = unseal(landing, channel.opening(), channel.pool)
    # page id 3 is the prompt's page 2, sealed with page 3 (id 4) in one chunk of the batch
    assert opened.problem is not None
    assert opened.problem.startswith("the seal of prompt pages [2, 4) does not hold")
    assert torch.count_nonzero(channel.pool.k) == 0  # nothing was moved


def test_a_genuine_chunk_moved_to_another_slot_refuses() -> None:
    channel = Channel(16)
    landing = channel.slots.open(channel.grants)
    channel.send()
    size = channel.slots.slot_bytes
    ctypes.memmove(channel.slot(8), channel.slot(7), size)  # page 0's chunk where page 1's is
    assert unseal(landing, channel.opening(), channel.pool).problem is not None


def test_nothing_lands_after_the_slots_are_withdrawn() -> None:
    channel = Channel(2)
    landing = channel.slots.open(channel.grants)
    landing.withdraw()
    with pytest.raises(TransferError, match="not registered"):
        channel.send()
    landing.withdraw()  # idempotent
    assert channel.registered() == []


def test_only_the_written_pages_are_opened_the_others_stay_as_they_are() -> None:
    """A result that names fewer pages than were granted (only a drill gets one accepted): the
    pages not written are not opened and keep their bytes."""
    channel = Channel(2)
    landing = channel.slots.open(channel.grants)
    channel.send()
    channel.pool.k[:, 9] = 5.0
    opened = unseal(landing, channel.opening(written=2), channel.pool)
    assert opened.problem is None
    assert torch.equal(opened.k[:, 4], channel.pool.k[:, 9])
    assert torch.equal(opened.k[:, 0], channel.staging.k[:, 0])


def test_the_sealing_plan_is_one_chunk_per_run_of_pages_within_a_batch() -> None:
    grants = [PageGrant(p, 1) for p in (7, 8, 9, 3, 4)]
    assert chunks(grants, 16) == [Chunk(0, 3, 7), Chunk(3, 2, 3)]
    # batches [7, 8] [9, 3] [4]: the run 3-4 is split where the batch ends
    assert chunks(grants, 2) == [Chunk(0, 2, 7), Chunk(2, 1, 9), Chunk(3, 1, 3), Chunk(4, 1, 4)]
    assert chunks(grants, 1) == [Chunk(k, 1, g.page_id) for k, g in enumerate(grants)]


@pytest.mark.gpu
def test_the_device_path_seals_from_and_moves_into_gpu_pages() -> None:
    """On a GPU the staged pages and the pool are device memory: sealing copies each batch to
    the host, opening moves the pages back to the device (``scripts/gpu-check`` runs this)."""
    staging = KVCache(2, 8, 4, 2, 3, torch.bfloat16, "cuda")
    staging.k.copy_(torch.randn_like(staging.k))
    staging.v.copy_(torch.randn_like(staging.v))
    pool = KVCache(2, 12, 4, 2, 3, torch.bfloat16, "cuda")
    sender, receiver = InProcessTransport(), InProcessTransport()
    slots = LandingSlots(layout_of(pool), receiver, 2)
    target = TransferTarget(
        receiver.endpoint, "inst", KvChannel.SEALED, (slots.base,), layout_of(pool), 2
    )
    grants = tuple(PageGrant(p, 1) for p in DST_PAGES)
    seal = Seal(new_key())
    landing = slots.open(grants)
    batches = SealedBatches(
        staging=staging,
        source_pages=SRC_PAGES,
        target=target,
        grants=grants,
        n_tokens=N_TOKENS,
        seal=seal,
        binding=BINDING,
        transport=sender,
    )
    for batch in batches.batches():
        sender.write(target.endpoint, batch)
    opened = unseal(landing, Opening(seal, BINDING, grants, len(grants)), pool)
    assert opened.problem is None
    opened.move_into(pool, DST_PAGES)
    staged = kv_digest(staging.k.cpu(), staging.v.cpu(), SRC_PAGES, N_TOKENS)
    assert kv_digest(pool.k.cpu(), pool.v.cpu(), DST_PAGES, N_TOKENS) == staged
    assert pool.k.device.type == "cuda"
