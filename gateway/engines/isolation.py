"""Per-tenant prefix-cache isolation in front of vLLM and SGLang.

Both engines share KV pages between requests whose prompts start alike; without a salt, a tenant
can learn from timing (or, on a buggy path, from content) that another tenant sent a prefix
(CVE-2025-46570). Each engine takes a per-request field that namespaces its prefix cache
(``cache_salt``). The gateway owns that field: a client's own value never reaches an engine (the
OpenAI edge accepts and drops it), and the gateway sets a salt derived from the tenant with a
server-side key, so two tenants never share a namespace and a tenant cannot choose another's.

The salt is ``kvg1-`` + base64url(HMAC-SHA256(key, tenant id)): 48 characters, within vLLM's
128-character limit and free of the characters it refuses (``@ / \\`` and NUL).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from typing import Any

from gateway.engines.capacity import CapacitySnapshot

CLIENT_FIELDS = ("cache_salt",)
SALT_PREFIX = "kvg1-"


def tenant_salt(key: bytes, tenant_id: str) -> str:
    digest = hmac.new(key, tenant_id.encode("utf-8"), hashlib.sha256).digest()
    return SALT_PREFIX + base64.urlsafe_b64encode(digest).rstrip(b"=").decode("ascii")


def isolate(
    body: dict[str, Any], snapshot: CapacitySnapshot | None, *, key: bytes, tenant_id: str
) -> dict[str, Any]:
    """The body the engine receives: no client salt; the tenant's salt where the engine has one."""
    out = {name: value for name, value in body.items() if name not in CLIENT_FIELDS}
    field = snapshot.isolation.field if snapshot and snapshot.isolation else None
    if field is not None:
        out[field] = tenant_salt(key, tenant_id)
    return out
