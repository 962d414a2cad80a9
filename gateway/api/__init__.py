"""gateway.api."""
