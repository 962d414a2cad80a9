"""Console sessions: sign-in, look-up on every request, sign-out; in the database, so every replica
honours them.

Lifecycle of a session: the operator types the admin token into the sign-in form -> ``open_session``
draws a 256-bit token, stores only its SHA-256 (``ConsoleSession.token_hash``) with an absolute
expiry and a *binding* (an HMAC of the hash under the admin token), and the token travels only in
the ``HttpOnly``, ``SameSite=Strict`` cookie -> ``find_session`` on every console request: the row
exists, has not expired, and its binding matches the admin token the gateway holds now (changing
the admin token ends every session) -> ``close_session`` deletes the row (sign-out).

The CSRF token of a session is derived from its token (``SignedIn.csrf``): nothing more to store,
and a form can only be posted by a page that read it while signed in.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from sqlalchemy import delete
from sqlalchemy.orm import Session

from gateway.db.models import ConsoleSession

MAX_TOKEN_CHARS = 128  # a cookie longer than any token we issue is not looked up
_CSRF_CONTEXT = b"kvguard-console-csrf"


@dataclass(frozen=True, slots=True)
class SignedIn:
    """A live session, as the request that presented its cookie sees it."""

    token: str = field(repr=False)
    expires_at: datetime

    @property
    def csrf(self) -> str:
        """The token every form of this session carries (and every action checks)."""
        return hmac.new(self.token.encode(), _CSRF_CONTEXT, hashlib.sha256).hexdigest()


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def _binding(admin_secret: str, hashed: str) -> str:
    return hmac.new(admin_secret.encode(), hashed.encode(), hashlib.sha256).hexdigest()


def open_session(session: Session, *, admin_secret: str, ttl_s: float, now: datetime) -> SignedIn:
    """A new session (expired ones are deleted on the way: sign-ins are rare)."""
    session.execute(delete(ConsoleSession).where(ConsoleSession.expires_at <= now))
    token = secrets.token_urlsafe(32)
    hashed = token_hash(token)
    expires_at = now + timedelta(seconds=ttl_s)
    session.add(
        ConsoleSession(
            token_hash=hashed,
            binding=_binding(admin_secret, hashed),
            created_at=now,
            expires_at=expires_at,
        )
    )
    return SignedIn(token=token, expires_at=expires_at)


def find_session(
    session: Session, *, token: str, admin_secret: str, now: datetime
) -> SignedIn | None:
    """The live session of ``token``, or None (unknown, expired, or opened under another admin
    token)."""
    if not token or len(token) > MAX_TOKEN_CHARS:
        return None
    hashed = token_hash(token)
    row = session.get(ConsoleSession, hashed)
    if row is None or row.expires_at <= now:
        return None
    if not hmac.compare_digest(row.binding, _binding(admin_secret, hashed)):
        return None
    return SignedIn(token=token, expires_at=row.expires_at)


def close_session(session: Session, *, token: str) -> None:
    session.execute(delete(ConsoleSession).where(ConsoleSession.token_hash == token_hash(token)))
