"""gateway.services."""
