"""Engines found through the master (``kvpool gateway --discover``): the instances of its
routing index whose KV-event bridge announced an OpenAI server (``kvpool kv-events --url URL
--role ROLE``), polled every few seconds.

An instance that appears is added to the engine pool (down until a probe finds it healthy); one
the master no longer lists (its bridge silent past the instance TTL) is removed once no request
of the gateway's is in flight there; one whose URL or role changed is replaced. Engines given
on the command line are never removed. A gateway serves either colocated or disaggregated:
once any engine is a prefill or decode one, requests go prefill-then-decode and colocated
engines (role ``both``) are left unused (said once in the log). :func:`reconcile` is the pure part (tested without a
master); :class:`EngineDiscovery` the loop around it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from kvpool.client.router import InstanceInfo
from kvpool.common.errors import KVPoolError
from kvpool.common.logging import get_logger
from kvpool.gateway.engines import EnginePool, EngineSpec, EngineSpecError, parse_engines

log = get_logger(__name__)


@dataclass(slots=True)
class Changes:
    added: list[EngineSpec] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)   # "id: why", instances not served


def reconcile(pool: EnginePool, listed: Iterable[InstanceInfo], discovered: set[str]
              ) -> Changes:
    """Bring ``pool`` in line with the master's ``listed`` instances. ``discovered``: the ids
    this discovery added (updated in place); only those are ever removed."""
    changes = Changes()
    wanted: dict[str, EngineSpec] = {}
    for inst in listed:
        if not inst.url:
            continue
        try:
            [spec] = parse_engines(f"{inst.instance_id}={inst.url}", inst.role or "both")
        except (EngineSpecError, ValueError) as e:
            changes.refused.append(f"{inst.instance_id}: {e}")
            continue
        wanted[spec.instance_id] = spec
    for instance_id in sorted(discovered):
        spec = wanted.get(instance_id)
        if (spec is None or pool.engines[instance_id].spec != spec) \
                and pool.remove(instance_id):
            discovered.discard(instance_id)
            changes.removed.append(instance_id)
    for instance_id, spec in wanted.items():
        if instance_id in pool.engines:
            continue    # known (given on the command line, or a replacement still serving)
        pool.add(spec)
        discovered.add(instance_id)
        changes.added.append(spec)
    return changes


class EngineDiscovery:
    """``list_instances``: the master's live instances (blocking: run on a thread)."""

    def __init__(self, pool: EnginePool, list_instances: Callable[[], list[InstanceInfo]], *,
                 interval_s: float = 2.0):
        self.pool, self._list, self.interval_s = pool, list_instances, interval_s
        self.discovered: set[str] = set()
        self._task: asyncio.Task | None = None
        self._failing: str | None = None
        self._refused: set[str] = set()
        self._mixed = False

    async def refresh(self) -> Changes | None:
        """One poll of the master; None if it did not answer (logged once per outage)."""
        try:
            listed = await asyncio.to_thread(self._list)
        except KVPoolError as e:
            if self._failing != str(e):
                log.warning("discovery_unavailable", error=str(e),
                            retry_in_s=self.interval_s)
            self._failing = str(e)
            return None
        self._failing = None
        changes = reconcile(self.pool, listed, self.discovered)
        for spec in changes.added:
            log.info("engine_discovered", engine=spec.instance_id, url=spec.url, role=spec.role)
        for instance_id in changes.removed:
            log.info("engine_forgotten", engine=instance_id,
                     reason="the master no longer lists it")
        for why in set(changes.refused) - self._refused:
            log.warning("engine_not_served", detail=why)
        self._refused = set(changes.refused)
        roles = {e.spec.role for e in self.pool.engines.values()}
        mixed = "both" in roles and len(roles) > 1
        if mixed and not self._mixed:
            # The gateway serves one way: disaggregated once any engine has a role.
            log.warning("engine_roles_mixed", serving="disaggregated",
                        unused="the colocated engines (role both)")
        self._mixed = mixed
        return changes

    def start(self) -> EngineDiscovery:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="discovery")
        return self

    async def _run(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception:   # a bug must not end discovery: logged, and it goes on
                log.exception("discovery_crashed")
            await asyncio.sleep(self.interval_s)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
