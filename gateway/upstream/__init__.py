"""gateway.upstream."""
