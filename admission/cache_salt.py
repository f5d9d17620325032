"""A tenant's prefix cache is its own: the salt the edge writes into every request it forwards.

vLLM keys a prompt's cached blocks by its tokens and, from its first block on, the request's
`cache_salt`; two requests with different salts never share a block, so a tenant cannot learn
whether another sent a prompt (its cached_tokens or its first token's speed would tell). The
edge sets the salt of the tenant's cache group (its own id by default, `tenants.<id>.cache_group`
to share) over whatever the client sent, and starts the prompt fingerprint's chain from the same
salt: the ledger, the sidecars' prefix index and the engine agree per group.

A salt is HMAC-SHA256(secret, group), never the tenant id in clear: the secret is generated
once by the first sidecar (32 random bytes in Redis, SET NX) and read by every other, so that
all sidecars write the same salts into the edge table whatever host they run on.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
from typing import Any

from admission.policy import Policy

log = logging.getLogger(__name__)

SECRET_KEY = "adm:cache_salt_secret"
SALT_HEX = 32  # hex digits of a salt (128 bits)


def group_of(policy: Policy, tenant: str) -> str:
    """The cache group a tenant's requests are salted as: `g:<name>` for a shared group, or
    `t:<tenant>` (its own)."""
    t = policy.tenants.get(tenant)
    return f"g:{t.cache_group}" if t is not None and t.cache_group else f"t:{tenant}"


def salt(secret: bytes, group: str) -> str:
    """The cache salt of a group, from the shared secret."""
    return hmac.new(secret, group.encode(), hashlib.sha256).hexdigest()[:SALT_HEX]


def salts(policy: Policy, secret: bytes | None) -> dict[str, str]:
    """Tenant → its cache salt ({} without the secret: the edge then gives every request a
    salt of its own, uncached)."""
    if secret is None:
        return {}
    return {tid: salt(secret, group_of(policy, tid)) for tid in policy.tenants}


async def read_secret(redis: Any) -> bytes:
    """The sidecars' shared secret, created by whichever sidecar asks first."""
    await redis.set(SECRET_KEY, secrets.token_hex(32), nx=True)
    value = await redis.get(SECRET_KEY)
    if not value:
        raise RuntimeError("the cache salt secret vanished from Redis right after SET NX")
    return value if isinstance(value, bytes) else str(value).encode()
