"""A served process's heap, settled once it has started: ``settle_heap``.

CPython's cycle collector walks every tracked object of the generation it collects; a full
(generation 2) collection walks the whole heap. A gateway's heap after start-up is mostly what
never goes away -- modules, the OpenAPI models, SQLAlchemy's mappers, litellm's tables -- some
200,000 objects, and walking them took 45-70 ms, every few seconds under load: requests that
arrived meanwhile waited that long (at 500 requests/s the gateway's p99 was 6.6-40 ms with them,
3.5-5.0 ms once frozen; docs/benchmarks.md, issue 33's step 4). ``gc.freeze`` moves what exists now
to a generation no collection walks; what is created later is collected as before. Frozen objects
that later become cyclic garbage are never freed, so it is done once, after start-up, in a process
that serves (not in a test process that builds many apps).
"""

from __future__ import annotations

import gc


def settle_heap() -> int:
    """Collect what start-up left as garbage, then freeze the rest; how many objects froze."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
