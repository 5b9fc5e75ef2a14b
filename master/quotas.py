"""What each tenant's keys hold in the index, against the tenants' byte quotas (SECURITY.md,
"Tenants"; the namespaces are common/tenants.py).

A tenant's usage is its objects, PENDING and COMPLETE, and their sizes, each object once
whatever its replicas. A PutStart that would take a tenant past its quota is refused for that
key with QuotaExceeded before anything is placed or evicted, so one tenant can neither fill
the cluster nor make it evict for more than its share. Of its quota, a tenant's hard pins may
hold ``pin_quota_fraction`` (the cluster-wide pin quota's fraction), so pins cannot lock a
tenant's whole quota.

Fair eviction: a put that must evict takes, first, victims of tenants holding more than their
share (:meth:`TenantUsage.over_share`: their quota, or without one an equal part of the
capacity among the tenants holding objects), in the eviction policy's order, and only then
any victim; so a tenant within its share loses objects to another's puts only once nothing
of a tenant over its share can make the room. Quotas come from
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
    pinned: int = 0     # of ``bytes``, those of hard-pinned objects


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
        """(Its pins, if any, are taken off by :meth:`pins_changed`, before or after.)"""
        tenant = tenant_of(key)[0]
        u = self.usage[tenant]
        u.objects -= 1
        u.bytes -= size
        if not u.objects:
            del self.usage[tenant]

    def pins_changed(self, key: str, size: int) -> None:
        """A hard pin of ``size`` bytes came (> 0) or went (< 0) on ``key``'s object."""
        u = self.usage.get(tenant_of(key)[0])
        if u is not None:
            u.pinned += size

    def check_pin(self, key: str, size: int, fraction: float) -> None:
        """QuotaExceeded if a hard pin of ``size`` bytes more would take its tenant's pins
        past ``fraction`` of its quota (a tenant without one: unbounded here)."""
        tenant = tenant_of(key)[0]
        quota = self.quota(tenant) if self.quotas else None
        u = self.usage.get(tenant)
        if quota is not None and u is not None and u.pinned + size > fraction * quota:
            raise QuotaExceeded(
                f"tenant {tenant!r} has {format_size(u.pinned)} hard-pinned, and its pins may "
                f"hold {fraction} of its quota of {format_size(quota)}: unpin some, or pin "
                "with a ttl_s (a soft pin)")

    def over_share(self, capacity: int) -> set[str] | None:
        """The tenants holding more than their share of ``capacity`` bytes (see the module
        docstring); None when fewness makes the question moot (one tenant or none)."""
        if len(self.usage) < 2:
            return None
        return {t for t, u in self.usage.items() if u.bytes > self.share(t, capacity)}

    def share(self, tenant: str, capacity: int) -> int:
        """``tenant``'s share of ``capacity`` bytes: its quota, or without one an equal part
        among the tenants holding objects (``tenant`` one of them)."""
        if self.quotas and (quota := self.quota(tenant)) is not None:
            return quota
        return capacity // (len(self.usage) + (tenant not in self.usage))

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
