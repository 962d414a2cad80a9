"""A world as the few lines a counterexample step prints: requests, pages, writes, messages."""

from __future__ import annotations

from backend.verify.world import World


def render_world(world: World) -> str:
    from backend.verify.actions import describe

    lines = []
    for index, request in enumerate(world.requests):
        name = world.owners[index]
        state = request.state.value if request.state is not None else "not sent"
        moved = f" handoff={request.handoff.value}" if request.handoff else ""
        error = f" error={request.error_code}" if request.error_code else ""
        lines.append(f"  {name.request_id} (tenant {name.tenant}): {state}{moved}{error}")
    pages = []
    for page_id in range(world.pool.num_pages):
        snap = world.pool.page(page_id)
        holder = snap.owner.request_id if snap.owner else "-"
        cell = world.memory[page_id]
        held = "0" if cell.request_index is None else f"r{cell.request_index}[{cell.position}]"
        late = "!" if cell.late else ""
        pages.append(f"{page_id}:{snap.state.value}/g{snap.generation}/{holder}/{held}{late}")
    lines.append(f"  decode d{world.instance} pages: " + "  ".join(pages))
    if world.sealed and (world.registered or any(c.writer for c in world.landing)):
        slots = []
        for page_id, cell in enumerate(world.landing):
            mark = "R" if page_id in world.registered else "-"
            held = "0" if not cell.writer else f"{cell.writer}[{cell.position}]"
            slots.append(f"{page_id}:{mark}/{held}{'!' if cell.late else ''}")
        lines.append("  landing slots (R: registered): " + "  ".join(slots))
    for target in sorted(world.adversary):
        lines.append(
            f"  in flight: adversary write into {'slot' if world.sealed else 'page'} {target}"
        )
    for key, handoff in sorted(world.handoffs.items()):
        extra = " placeholder" if handoff.placeholder else ""
        lines.append(
            f"  prefill {key}: {handoff.state.value} written={handoff.written}/{handoff.tokens}"
            f"{extra}{' cancelled' if handoff.cancelled else ''}"
            f"{' lease-over' if handoff.lease_over else ''}"
        )
    for write in sorted(world.writes, key=repr):
        lines.append(
            f"  in flight: write d{write.instance} page {write.page.page_id}@g"
            f"{write.page.generation} <- {write.handoff_id}[{write.position}]"
        )
    for message in sorted(world.wire, key=repr):
        lines.append(f"  on the wire: {describe(message)}")
    return "\n".join(lines)
