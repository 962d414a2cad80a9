"""gateway.db."""
