"""gateway.limits."""
