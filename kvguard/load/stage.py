"""Which size classes the load users send now: set by a load shape, read by the users.

A process-wide holder because Locust loads the locustfile and a shape file as separate modules
that cannot import each other (see ``kvguard.load.shape``); both import this package module, so
they share it. ``None``: every size class of the plan.
"""

from __future__ import annotations

from dataclasses import dataclass

# The long-context ramp: short prompts, then near the limit, then over it (one token over, and a
# prompt that alone exceeds it: both must be refused with context_length_exceeded).
RAMP_STAGES: tuple[tuple[str, ...], ...] = (("short",), ("near",), ("over", "over_prompt"))


@dataclass
class Stage:
    sizes: tuple[str, ...] | None = None


CURRENT_STAGE = Stage()
