"""The sealed KV channel's memory: decode's landing slots, prefill's sealed batches, unsealing.

A page's chunk (plaintext) is page-major, so that one page is one contiguous run: K then V, layer
by layer, ``[page_size, kv_heads, head_dim]`` each; in the prompt's last page the slots beyond the
prompt are zeros (never anyone's old KV). Sealed (``backend.disagg.seal``), it is the nonce, the
ciphertext and the tag: ``slot_bytes`` in all.

Lifecycle of one handoff's bytes:

1. Decode, at the ticket (engine thread): ``LandingSlots.open`` registers with the transport the
   slots of the handoff's granted pages -- slot ``p`` belongs to pool page ``p`` -- and nothing
   else; the slots are host memory mapped for this purpose alone (never handed to any other
   object, so a write that lands late can only ever meet ciphertext).
2. Prefill, per batch (transfer thread): ``SealedBatches`` reads the staged pages, seals each
   page's chunk into its own buffer (registered only when the transport needs sources registered:
   RDMA) and yields the segments that write each run of consecutive pages into its slots.
3. Decode, at the result (engine thread): ``Landing.take`` withdraws the slots (no new transfer
   may touch them), then copies them once into private memory; ``unseal`` opens every written
   page's chunk from that copy -- never from registered memory read twice -- into a scratch
   ``Unsealed``; the checks run on it; only on acceptance ``move_into`` copies it into the pages.
   An abort or a lost handoff withdraws the slots at once (``Landing.withdraw``).

Slot ``p`` is reused only when page ``p`` is allocated again, i.e. after its quarantine: the
drain that keeps a late write of an aborted handoff from reaching a reader covers its slot too,
and a late write into a reallocated slot only makes that handoff's seal fail.

On a GPU the staged pages and the pool live on the device: ``SealedBatches`` copies each batch to
the host before sealing and ``move_into`` copies the opened pages to the device (the AEAD runs on
the host, in OpenSSL); ``scripts/gpu-check`` runs that path.
"""

from __future__ import annotations

import logging
import mmap
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from backend.disagg.kvio import runs
from backend.disagg.protocol import KvLayout, PageGrant, TransferTarget
from backend.disagg.seal import OVERHEAD, Binding, Seal
from backend.model.kv_cache import KVCache
from backend.transport.base import KvTransport, Segment, TransferError

log = logging.getLogger("kvguard.disagg.channel")


def chunk_bytes(layout: KvLayout) -> int:
    """Plaintext bytes of one page's chunk: K and V of every layer."""
    return 2 * layout.num_layers * layout.page_bytes


def slot_bytes(layout: KvLayout) -> int:
    """Bytes of one landing slot: a sealed chunk."""
    return chunk_bytes(layout) + OVERHEAD


# -- decode: the landing slots ------------------------------------------------------------------


class LandingSlots:
    """One slot per pool page, in memory mapped for this alone; registered only per handoff."""

    def __init__(self, layout: KvLayout, transport: KvTransport) -> None:
        self.layout = layout
        self.slot_bytes = slot_bytes(layout)
        self._transport = transport
        # Anonymous pages: zero until written, touched only as handoffs use them, and never
        # reused by the allocator for anything else (a late write meets only ciphertext).
        self._map = mmap.mmap(-1, layout.num_pages * self.slot_bytes)
        flat = torch.frombuffer(self._map, dtype=torch.uint8)
        self.slots = flat.view(layout.num_pages, self.slot_bytes)

    @property
    def base(self) -> int:
        return int(self.slots.data_ptr())

    def open(self, grants: Sequence[PageGrant]) -> Landing:
        """Register the slots of ``grants`` (run by run) for one handoff."""
        landing = Landing(self, [g.page_id for g in grants])
        try:
            for _, first, length in runs(landing.page_ids):
                address = self.base + first * self.slot_bytes
                self._transport.register(address, length * self.slot_bytes)
                landing.registered.append(address)
        except TransferError:
            landing.withdraw()
            raise
        return landing

    def unregister(self, address: int) -> None:
        self._transport.unregister(address)


@dataclass(slots=True)
class Landing:
    """One handoff's registered slots; ``withdraw`` is idempotent and runs whatever the end."""

    slots: LandingSlots
    page_ids: list[int]
    registered: list[int] = field(default_factory=list)

    def withdraw(self) -> None:
        while self.registered:
            address = self.registered.pop()
            try:
                self.slots.unregister(address)
            except TransferError as exc:  # the slot memory holds ciphertext only
                log.error("withdrawing a landing slot run failed: %s", exc)

    def take(self) -> torch.Tensor:
        """Withdraw, then copy the slots once into private memory ``[pages, slot_bytes]``."""
        self.withdraw()
        ids = torch.tensor(self.page_ids, dtype=torch.int64)
        return self.slots.slots.index_select(0, ids)


# -- decode: opening the seals ------------------------------------------------------------------


@dataclass(slots=True)
class Unsealed:
    """The opened prompt pages, ``[pages, 2, layers, page_size, heads, dim]`` on the host, with
    K and V views ``[layers, pages, page_size, heads, dim]`` (the pool's layout)."""

    pages: torch.Tensor
    problem: str | None  # the first chunk that did not open, None when every one did
    copy_s: float = 0.0
    open_s: float = 0.0

    @property
    def k(self) -> torch.Tensor:
        return self.pages[:, 0].transpose(0, 1)

    @property
    def v(self) -> torch.Tensor:
        return self.pages[:, 1].transpose(0, 1)

    def move_into(self, kv: KVCache, page_ids: Sequence[int]) -> None:
        """Copy the opened pages into the pool's pages (to the device, on a GPU)."""
        kv.write_pages(list(page_ids), self.k.to(kv.device), self.v.to(kv.device))


@dataclass(frozen=True, slots=True)
class Opening:
    """What decode needs to open one handoff's chunks."""

    seal: Seal = field(repr=False)
    binding: Binding
    grants: tuple[PageGrant, ...]
    written: tuple[int, ...]  # positions prefill reports written (all of them, unless a drill)
    authenticate: bool = True  # False only with the skip_seal_check drill


def unseal(landing: Landing, opening: Opening, kv: KVCache) -> Unsealed:
    """Take the landing slots and open every written position's chunk into a scratch copy.

    Positions not written keep the pool's current bytes, so that the checksum (and, under a drill
    that lets such a result through, the move) sees the pages as they are.
    """
    started = time.perf_counter()
    private = landing.take()
    copied = time.perf_counter()
    n = len(opening.grants)
    shape = (n, 2, kv.num_layers, kv.page_size, kv.num_kv_heads, kv.head_dim)
    pages = torch.empty(shape, dtype=kv.dtype)
    if len(opening.written) < n:
        k, v = kv.read_pages([g.page_id for g in opening.grants])
        pages.copy_(torch.stack((k, v)).permute(2, 0, 1, 3, 4, 5))
    problem = None
    for position in opening.written:
        sealed = private[position].numpy().data
        out = pages[position].view(torch.uint8).view(-1).numpy().data
        if not opening.authenticate:
            opening.seal.open_unauthenticated(sealed, out)
            continue
        aad = opening.binding.associated_data(position, opening.grants[position])
        if not opening.seal.open_into(sealed, aad, out):
            problem = f"page {position} of the prompt is not sealed for this handoff"
            break
    done = time.perf_counter()
    return Unsealed(pages, problem, copied - started, done - copied)


# -- prefill: sealing batches ----------------------------------------------------------------


class SealedBatches:
    """Prefill's sealed transfer of one handoff: seal each batch of pages, yield its segments.

    The ciphertext buffer holds one batch and is reused (``write`` is synchronous); it is
    registered for this handoff only, and only when the transport needs registered sources.
    """

    def __init__(
        self,
        *,
        staging: KVCache,
        source_pages: Sequence[int],
        target: TransferTarget,
        grants: Sequence[PageGrant],
        n_tokens: int,
        seal: Seal,
        binding: Binding,
        transport: KvTransport,
    ) -> None:
        if len(source_pages) != len(grants):
            raise ValueError("source and destination page counts differ")
        self._staging, self._source = staging, list(source_pages)
        self._target, self._grants = target, list(grants)
        self._n_tokens, self._seal, self._binding = n_tokens, seal, binding
        self._transport = transport
        self.slot_bytes = slot_bytes(target.layout)
        width = min(len(grants), target.max_batch_pages)
        self._buffer = torch.empty(width * self.slot_bytes, dtype=torch.uint8)
        self._registered = transport.registers_sources
        if self._registered:
            transport.register(self._buffer.data_ptr(), self._buffer.numel())
        self.seal_s = 0.0

    def batches(self) -> Iterator[list[Segment]]:
        step = self._target.max_batch_pages
        for first in range(0, len(self._grants), step):
            yield self._sealed(first, min(len(self._grants), first + step))

    def close(self) -> None:
        if self._registered:
            self._registered = False
            self._transport.unregister(self._buffer.data_ptr())

    def _sealed(self, first: int, end: int) -> list[Segment]:
        started = time.perf_counter()
        plain = self._plaintext(first, end)
        for index in range(end - first):
            position = first + index
            out = self._buffer[index * self.slot_bytes : (index + 1) * self.slot_bytes]
            aad = self._binding.associated_data(position, self._grants[position])
            chunk = plain[index].view(torch.uint8).view(-1).numpy().data
            self._seal.close_into(chunk, aad, out.numpy().data)
        self.seal_s += time.perf_counter() - started
        segments = []
        base, src = self._target.bases[0], self._buffer.data_ptr()
        for index, page_id, length in runs([g.page_id for g in self._grants[first:end]]):
            segments.append(
                Segment(
                    src + index * self.slot_bytes,
                    base + page_id * self.slot_bytes,
                    length * self.slot_bytes,
                )
            )
        return segments

    def _plaintext(self, first: int, end: int) -> torch.Tensor:
        """Pages ``[first, end)`` of the prompt, page-major on the host, the tail zeroed."""
        k, v = self._staging.read_pages(self._source[first:end])
        plain = torch.stack((k, v)).permute(2, 0, 1, 3, 4, 5).contiguous().cpu()
        page_size = self._staging.page_size
        last_tokens = self._n_tokens - (end - 1) * page_size  # of the batch's last page
        if last_tokens < page_size:
            plain[-1, :, :, last_tokens:] = 0
        return plain
