"""Tenants' namespaces: the key a tenant's client names and the key the master and the store
nodes keep (SECURITY.md, "Tenants").

A client's certificate (or bearer token) names its tenant. The master, where it checks the
caller (master/auth.py), rewrites every key of a client's request into the tenant's namespace
before a handler sees it, so tenant A's ``x`` and tenant B's ``x`` are two objects and no call
of B's can name A's. The stored key of tenant ``t``'s key ``k`` is ``MARK t MARK k``; the
tenant ``default`` (kvpool's own clients, and every client of a master without credentials)
keeps its keys as they are, so a cluster that had no tenants keeps its objects. A default key
that itself begins with ``MARK`` is namespaced like any other tenant's, so that no key of one
tenant is ever another's: every stored key names exactly one tenant (:func:`tenant_of`).

Store nodes never see tenants, only stored keys: a writer that hands its node a put's record
(RESERVE, SEAL) names the stored key, :func:`scoped` of its tenant, which the master tells it in
the PutStart answer; the write grant binds the record to that key.
"""

from __future__ import annotations

from kvpool.common.errors import InvalidArgument
from kvpool.common.types import validate_key

DEFAULT = "default"
MARK = "\x1d"                 # ASCII group separator: no key a client means begins with it
MAX_TENANT_BYTES = 64         # a certificate's common name is at most 64 characters


def validate_stored_key(key: str) -> str:
    """``key`` if it is a valid stored key (the master's), else InvalidArgument: the key its
    client names is valid (:func:`~kvpool.common.types.validate_key`: the same limits for
    every tenant), and so is its tenant's name."""
    if isinstance(key, str) and key.startswith(MARK):
        tenant, named = tenant_of(key)
        if named is not key:
            check_tenant(tenant)
        validate_key(named)
        return key
    return validate_key(key)


def check_tenant(tenant: str) -> str:
    """``tenant`` if it can name a namespace, else InvalidArgument."""
    if not tenant or MARK in tenant or len(tenant.encode("utf-8", "replace")) > MAX_TENANT_BYTES:
        raise InvalidArgument(f"tenant {tenant[:80]!r} cannot name a namespace (1 to "
                              f"{MAX_TENANT_BYTES} bytes, no U+001D)")
    return tenant


def scoped(tenant: str, key: str) -> str:
    """The stored key of ``tenant``'s ``key``; ``tenant`` "" (an admin, or a master without
    credentials): ``key`` itself, unscoped."""
    if not tenant or (tenant == DEFAULT and not key.startswith(MARK)):
        return key
    return f"{MARK}{tenant}{MARK}{key}"


def scoped_all(tenant: str, keys) -> list[str] | None:
    """:func:`scoped` of each key; None when no key changes (the default tenant's common
    case: its request goes on untouched)."""
    if not tenant or (tenant == DEFAULT and MARK not in "".join(keys)):
        # (MARK anywhere, not only at a key's start: a rare key takes the slow way, no harm)
        return None
    return [scoped(tenant, k) for k in keys]


def tenant_of(stored_key: str) -> tuple[str, str]:
    """(tenant, the key its client names) of a stored key."""
    if stored_key.startswith(MARK):
        tenant, sep, key = stored_key[1:].partition(MARK)
        if sep:
            return tenant, key
    return DEFAULT, stored_key
