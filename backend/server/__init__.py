"""HTTP edge of the bundled engine: one contract for the unified, prefill and decode roles."""
