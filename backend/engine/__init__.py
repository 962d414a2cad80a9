"""The engine: the pure core (``backend.core``) driven over the torch model (``backend.model``)."""
