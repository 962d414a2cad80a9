"""The adversary on the transfer port, in the model: what it can reach and what its bytes are.

It holds no ticket, so no seal key, and it has read the code: it reaches whatever is registered
with the transport (Mooncake's handshake lists it), writes there at any moment, and a write it
started lands whenever it likes -- also after the memory was withdrawn (Mooncake's TCP server
validates a write's range once, then copies as bytes arrive). Its bytes carry the KV the page's
holder expects at that position (the checksum, crc32, is forgeable: it is no MAC), so only a
seal it cannot make -- or, on the open channel, nothing -- tells them apart.
"""

from __future__ import annotations

from backend.verify.world import ADVERSARY, Cell, World


def reachable(world: World) -> frozenset[int]:
    """Slots registered now (sealed channel), or every page a request holds (open channel:
    decode's pools are registered for the process's life)."""
    if world.sealed:
        return world.registered
    return frozenset(ref.page_id for request in world.requests for ref in request.refs)


def start_write(world: World, target: int) -> None:
    world.adversary = world.adversary | {target}


def land_write(world: World, target: int) -> None:
    world.adversary = world.adversary - {target}
    forged = _forged(world, target)
    if world.sealed:
        world.landing[target] = forged
    else:
        world.memory[target] = forged


def _forged(world: World, page_id: int) -> Cell:
    """The bytes the page's current holder would accept as its own KV, by their checksum."""
    for index, request in enumerate(world.requests):
        spec = world.bound.requests[index]
        for position, ref in enumerate(request.refs[: spec.prompt_tokens]):
            if ref.page_id == page_id:
                return Cell(index, position, ADVERSARY, ref.generation)
    return Cell(None, 0, ADVERSARY)
