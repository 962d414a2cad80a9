"""gateway.api.routes."""
