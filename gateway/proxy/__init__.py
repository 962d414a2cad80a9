"""gateway.proxy: the tenant request path (admission, relay, finalisation)."""
