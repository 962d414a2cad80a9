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
2. Prefill, per batch (transfer thread): ``SealedBatches`` seals each chunk of the batch into
   its own buffer (registered only when the transport needs sources registered: RDMA) and yields
   one segment per chunk, into the slots of its pages.
3. Decode, at the result (engine thread): ``Landing.take`` withdraws the slots (no new transfer
   may touch them), then copies them once into private memory; ``unseal`` opens every chunk of
   the pages prefill reports written from that copy -- never from registered memory read twice --
   into a scratch ``Unsealed``; the checks run on it; only on acceptance ``move_into`` copies it
   into the pages. An abort or a lost handoff withdraws the slots at once (``Landing.withdraw``).

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
import threading
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
    """Plaintext bytes of one page: K and V of every layer."""
    return 2 * layout.num_layers * layout.page_bytes


def slot_bytes(layout: KvLayout) -> int:
    """Bytes of one landing slot: one page sealed on its own."""
    return chunk_bytes(layout) + OVERHEAD


@dataclass(frozen=True, slots=True)
class Chunk:
    """One sealed chunk: the prompt's pages ``[first, first + pages)``, whose ids are
    consecutive from ``page_id``."""

    first: int
    pages: int
    page_id: int


def chunks(grants: Sequence[PageGrant], max_batch_pages: int) -> list[Chunk]:
    """The sealing plan: one chunk per run of consecutive page ids within each transfer batch."""
    plan = []
    for first in range(0, len(grants), max_batch_pages):
        batch = [g.page_id for g in grants[first : first + max_batch_pages]]
        plan += [Chunk(first + start, length, page_id) for start, page_id, length in runs(batch)]
    return plan


# -- host scratch memory ------------------------------------------------------------------------

SCRATCH_KEEP_BYTES = 64 << 20  # larger scratch is allocated per use, not kept


class _Scratch(threading.local):
    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}


_SCRATCH = _Scratch()


def scratch(name: str, nbytes: int) -> torch.Tensor:
    """A host byte tensor of ``nbytes`` this thread reuses under ``name`` (valid until its next
    call with that name): a fresh allocation of a few MiB costs page faults worth ten times the
    copy into it (``python -m bench.bench_handoff``). Above ``SCRATCH_KEEP_BYTES``, a fresh one."""
    if nbytes > SCRATCH_KEEP_BYTES:
        return torch.empty(nbytes, dtype=torch.uint8)
    kept = _SCRATCH.buffers.get(name)
    if kept is None or kept.numel() < nbytes:
        kept = torch.empty(nbytes, dtype=torch.uint8)
        _SCRATCH.buffers[name] = kept
    return kept[:nbytes]


def _pages(name: str, n: int, kv: KVCache) -> torch.Tensor:
    """Scratch for ``n`` pages, ``[n, 2, layers, page_size, heads, dim]`` in ``kv``'s dtype."""
    shape = (n, 2, kv.num_layers, kv.page_size, kv.num_kv_heads, kv.head_dim)
    itemsize = torch.empty((), dtype=kv.dtype).element_size()
    nbytes = itemsize * n * 2 * kv.num_layers * kv.page_size * kv.num_kv_heads * kv.head_dim
    return scratch(name, nbytes).view(kv.dtype).view(shape)


# -- decode: the landing slots ------------------------------------------------------------------


class LandingSlots:
    """One slot per pool page, in memory mapped for this alone; registered only per handoff.
    ``max_batch_pages`` is decode's transfer-batch limit: prefill's chunks follow it."""

    def __init__(self, layout: KvLayout, transport: KvTransport, max_batch_pages: int) -> None:
        self.layout = layout
        self.max_batch_pages = max_batch_pages
        self.slot_bytes = slot_bytes(layout)
        self._transport = transport
        # Anonymous pages: zero until written, touched only as handoffs use them, and never
        # reused by the allocator for anything else (a late write meets only ciphertext).
        self._map = mmap.mmap(-1, layout.num_pages * self.slot_bytes)
        self.memory = memoryview(self._map)
        self.base = int(torch.frombuffer(self._map, dtype=torch.uint8).data_ptr())

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

    def take(self) -> memoryview:
        """Withdraw, then copy the slots once into private memory (this thread's scratch), in
        grant order."""
        self.withdraw()
        size = self.slots.slot_bytes
        arena = self.slots.memory
        private = _bytes(scratch("landing copy", len(self.page_ids) * size))
        for index, first, length in runs(self.page_ids):
            private[index * size : (index + length) * size] = arena[
                first * size : (first + length) * size
            ]
        return private


# -- decode: opening the seals ------------------------------------------------------------------


@dataclass(slots=True)
class Unsealed:
    """The opened prompt pages, ``[pages, 2, layers, page_size, heads, dim]`` on the host, with
    K and V views ``[layers, pages, page_size, heads, dim]`` (the pool's layout). They live in the
    opening thread's scratch: used (checked, moved) before that thread opens another handoff."""

    pages: torch.Tensor
    problem: str | None  # the first chunk whose seal did not hold, None when every one did
    copy_s: float = 0.0
    open_s: float = 0.0

    @property
    def k(self) -> torch.Tensor:
        return self.pages[:, 0].transpose(0, 1)

    @property
    def v(self) -> torch.Tensor:
        return self.pages[:, 1].transpose(0, 1)

    def move_into(self, kv: KVCache, page_ids: Sequence[int]) -> None:
        """Copy the opened pages into the pool's pages (to the device, on a GPU), run by run."""
        pages = self.pages.to(kv.device)
        for start, first, length in runs(page_ids):
            run = pages[start : start + length]
            kv.k[:, first : first + length].copy_(run[:, 0].transpose(0, 1))
            kv.v[:, first : first + length].copy_(run[:, 1].transpose(0, 1))


@dataclass(frozen=True, slots=True)
class Opening:
    """What decode needs to open one handoff's chunks."""

    seal: Seal = field(repr=False)
    binding: Binding
    grants: tuple[PageGrant, ...]
    written: int  # prefill reports the first ``written`` pages written (all, unless a drill)
    authenticate: bool = True  # False only with the skip_seal_check drill


def unseal(landing: Landing, opening: Opening, kv: KVCache) -> Unsealed:
    """Take the landing slots and open every chunk of the written pages into a scratch copy.

    Pages not written keep the pool's current bytes, so that the checksum (and, under a drill
    that lets such a result through, the move) sees the pages as they are.
    """
    started = time.perf_counter()
    private = landing.take()
    copied = time.perf_counter()
    n = len(opening.grants)
    pages = _pages("opened pages", n, kv)
    if opening.written < n:
        k, v = kv.read_pages([g.page_id for g in opening.grants])
        pages.copy_(torch.stack((k, v)).permute(2, 0, 1, 3, 4, 5))
    plain, size = _bytes(pages), landing.slots.slot_bytes
    page = size - OVERHEAD
    problem = None
    plan = chunks(opening.grants[: opening.written], landing.slots.max_batch_pages)
    for chunk in plan:
        sealed = private[chunk.first * size : chunk.first * size + chunk.pages * page + OVERHEAD]
        into = plain[chunk.first * page : (chunk.first + chunk.pages) * page]
        if not opening.authenticate:
            opening.seal.open_unauthenticated(sealed, into)
            continue
        grants = opening.grants[chunk.first : chunk.first + chunk.pages]
        if not opening.seal.open_into(
            sealed, opening.binding.associated_data(chunk.first, grants), into
        ):
            problem = (
                f"the seal of prompt pages [{chunk.first}, {chunk.first + chunk.pages}) does "
                "not hold: not this handoff's KV"
            )
            break
    return Unsealed(pages, problem, copied - started, time.perf_counter() - copied)


def _bytes(tensor: torch.Tensor) -> memoryview:
    """A contiguous host tensor's memory as one flat, writable byte view (sliced per chunk at
    the cost of a memoryview slice, not a tensor index)."""
    return tensor.view(torch.uint8).view(-1).numpy().data


# -- prefill: sealing batches ----------------------------------------------------------------


class SealedBatches:
    """Prefill's sealed transfer of one handoff: seal each batch's chunks, yield its segments.

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
        self._target, self._grants = target, tuple(grants)
        self._n_tokens, self._seal, self._binding = n_tokens, seal, binding
        self._transport = transport
        self.slot_bytes = slot_bytes(target.layout)
        width = min(len(grants), target.max_batch_pages)
        self._buffer = scratch("sealed batch", width * self.slot_bytes)
        self._out = _bytes(self._buffer)
        self._plain: torch.Tensor | None = None
        self._registered = transport.registers_sources
        if self._registered:
            transport.register(self._buffer.data_ptr(), self._buffer.numel())
        self.seal_s = 0.0

    def batches(self) -> Iterator[list[Segment]]:
        started = time.perf_counter()
        plain = self._plaintext()  # the whole prompt, page-major, once
        self.seal_s += time.perf_counter() - started
        plan = chunks(self._grants, self._target.max_batch_pages)
        step = self._target.max_batch_pages
        for first in range(0, len(self._grants), step):
            yield self._sealed(plain, [c for c in plan if first <= c.first < first + step], first)

    def close(self) -> None:
        if self._registered:
            self._registered = False
            self._transport.unregister(self._buffer.data_ptr())

    def _sealed(self, plain: memoryview, batch: list[Chunk], first: int) -> list[Segment]:
        started = time.perf_counter()
        size, page = self.slot_bytes, self.slot_bytes - OVERHEAD
        base, src = self._target.bases[0], self._buffer.data_ptr()
        segments = []
        for chunk in batch:
            offset = (chunk.first - first) * size
            length = chunk.pages * page + OVERHEAD
            grants = self._grants[chunk.first : chunk.first + chunk.pages]
            self._seal.close_into(
                plain[chunk.first * page : (chunk.first + chunk.pages) * page],
                self._binding.associated_data(chunk.first, grants),
                self._out[offset : offset + length],
            )
            segments.append(Segment(src + offset, base + chunk.page_id * size, length))
        self.seal_s += time.perf_counter() - started
        return segments

    def _plaintext(self) -> memoryview:
        """The prompt's pages, page-major on the host, the last page's tail zeroed."""
        staging, n = self._staging, len(self._source)
        plain = _pages("plaintext", n, staging)
        for start, first, length in runs(self._source):  # slices, not index copies
            into = plain[start : start + length]
            into[:, 0].copy_(staging.k[:, first : first + length].transpose(0, 1))
            into[:, 1].copy_(staging.v[:, first : first + length].transpose(0, 1))
        last_tokens = self._n_tokens - (n - 1) * staging.page_size
        if last_tokens < staging.page_size:
            plain[-1, :, :, last_tokens:] = 0
        self._plain = plain  # keeps the memory the view below reads alive
        return _bytes(plain)
