"""The base of every error kvguard raises on purpose: a stable ``code``, the HTTP status it maps
to, content-free ``details``, and pickling by its constructor arguments.

The engine's errors (``backend.core.errors``) and the lifecycle refusal every package shares
(``contracts.lifecycle.InvalidTransition``) are built on it; the engine's HTTP edge turns one into
an OpenAI-style error body with ``code`` and ``http_status``. Pure: standard library only.
"""

from __future__ import annotations

from typing import Any


class KvguardError(Exception):
    """Base of every error kvguard raises on purpose.

    Subclasses call ``super().__init__(message, *constructor_args)`` so the error pickles.
    """

    code: str = "internal_error"
    http_status: int = 500

    def __init__(self, message: str, *init_args: Any) -> None:
        super().__init__(message)
        # Kept so the error pickles as `type(self)(*init_args)`; Exception's default would call
        # `type(self)(message)`, which subclasses with structured constructors cannot take.
        self._init_args = init_args or (message,)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (type(self), self._init_args)

    def details(self) -> dict[str, Any]:
        """Structured, content-free fields for logs, metrics and audit records."""
        return {"code": self.code}
