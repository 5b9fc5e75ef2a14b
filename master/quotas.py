"""What each tenant's keys hold in the index, against the tenants' byte quotas (SECURITY.md,
"Tenants"; the namespaces are common/tenants.py).

A tenant's usage is its objects, PENDING and COMPLETE, and their sizes, each object once
whatever its replicas. A PutStart that would take a tenant past its quota is refused for that
key with QuotaExceeded before anything is placed or evicted, so one tenant can neither fill
the cluster nor make it evict for more than its share. Quotas come from
``MasterConfig.tenant_quotas`` (``NAME=SIZE,...``; ``*`` for every tenant not named); a
tenant with none is bounded by the cluster's capacity only.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.common.config import format_size
from kvpool.common.errors import QuotaExceeded
from kvpool.common.tenants import tenant_of


@dataclass(slots=True)
class Usage:
    objects: int = 0
    bytes: int = 0


class TenantUsage:
    def __init__(self, quotas: dict[str, int] | None = None) -> None:
        self.quotas = dict(quotas or {})
        self.usage: dict[str, Usage] = {}

    def quota(self, tenant: str) -> int | None:
        """``tenant``'s quota in bytes (None: none)."""
        return self.quotas.get(tenant, self.quotas.get("*"))

    def added(self, key: str, size: int) -> None:
        tenant = tenant_of(key)[0]
        u = self.usage.get(tenant)
        if u is None:
            u = self.usage[tenant] = Usage()
        u.objects += 1
        u.bytes += size

    def removed(self, key: str, size: int) -> None:
        tenant = tenant_of(key)[0]
        u = self.usage[tenant]
        u.objects -= 1
        u.bytes -= size
        if not u.objects:
            del self.usage[tenant]

    def table(self) -> tuple[tuple[str, int, int, int | None], ...]:
        """(tenant, objects, bytes, quota or None) of each tenant holding objects, by name."""
        return tuple((t, u.objects, u.bytes, self.quota(t)) for t, u in sorted(self.usage.items()))

    def check(self, key: str, size: int) -> None:
        """QuotaExceeded if a new object of ``size`` bytes at ``key`` would take its tenant
        past its quota."""
        if not self.quotas:
            return
        tenant = tenant_of(key)[0]
        quota = self.quota(tenant)
        if quota is None:
            return
        u = self.usage.get(tenant) or Usage()
        if u.bytes + size > quota:
            raise QuotaExceeded(
                f"tenant {tenant!r} holds {format_size(u.bytes)} in {u.objects} objects, and "
                f"its quota is {format_size(quota)}: remove objects, or raise the master's "
                "--tenant-quotas")
