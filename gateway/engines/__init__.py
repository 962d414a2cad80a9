"""gateway.engines."""
