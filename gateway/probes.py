"""Watching the engines: their load, read from their own metrics, and their health.

Every ``interval_s`` each engine that is up is scraped (vLLM's ``/metrics``:
``vllm:num_requests_running`` + ``vllm:num_requests_waiting``, the requests ahead of a new one,
other clients' included); one that does not answer within ``timeout_s`` is marked down. A down
engine is probed (``/health``) once its back-off has passed, and is up again when it answers
200. The scrape reads only the lines it needs: vLLM's page is large and this runs on the
gateway's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp
from kvpool.common.logging import get_logger
from kvpool.gateway.engines import EnginePool
from kvpool.gateway.metrics import GatewayMetrics

log = get_logger(__name__)
_LOAD_SERIES = (b"vllm:num_requests_running{", b"vllm:num_requests_waiting{")


def reported_queue(page: bytes) -> int:
    """Requests running and waiting, summed over the page's engines (data-parallel ranks)."""
    total = 0.0
    for line in page.splitlines():
        if line.startswith(_LOAD_SERIES):
            with contextlib.suppress(ValueError, IndexError):
                total += float(line.rsplit(b" ", 1)[1])
    return int(total)


class EngineProber:
    def __init__(self, pool: EnginePool, session: aiohttp.ClientSession,
                 metrics: GatewayMetrics, *, interval_s: float = 1.0, timeout_s: float = 5.0):
        self.pool, self.session, self.metrics = pool, session, metrics
        self.interval_s, self.timeout_s = interval_s, timeout_s
        self._task: asyncio.Task | None = None

    def start(self) -> EngineProber:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="engine-probes")
        return self

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            try:
                await asyncio.gather(*(self._probe(i) for i in list(self.pool.engines)))
            except Exception:   # a bug must not end the probes: logged, and they go on
                log.exception("engine_probes_crashed")
            await asyncio.sleep(self.interval_s)

    async def _probe(self, instance_id: str) -> None:
        engine = self.pool[instance_id]
        if not engine.up and instance_id not in self.pool.due_for_probe():
            return
        path = "/metrics" if engine.up else "/health"
        try:
            async with self.session.get(engine.spec.url + path,
                                        timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as r:
                page = await r.read()
                ok = r.status == 200
        except (aiohttp.ClientError, TimeoutError) as e:
            ok, page, error = False, b"", f"{type(e).__name__}: {e}"
        else:
            error = f"{path} answered HTTP {r.status}"
        if instance_id not in self.pool.engines:   # removed meanwhile (discovery)
            return
        if not ok:
            self.metrics.failures.labels(instance_id, "probe").inc()
            if self.pool.failed(instance_id):
                log.warning("engine_down", engine=instance_id, reason="probe", error=error)
            return
        if path == "/metrics":
            self.pool.reported(instance_id, reported_queue(page))
        elif self.pool.healthy(instance_id):
            log.info("engine_up", engine=instance_id)
