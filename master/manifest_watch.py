"""Pushes manifest changes to the store nodes that watch them, and lets RPCs wait for that.

A PutEnd answers only after the nodes holding the committed objects were sent the commit, so a
master killed right after answering loses nothing it acknowledged: the nodes re-announce it.
A PutStart answers only after the removals of the objects it evicted were sent: otherwise a
master killed while the new object's bytes are being written over the evicted one's would
leave that one in a manifest, and a restarted master would serve it with the new bytes.
The wait costs one write on a stream that is already open (tens of microseconds; concurrent
PutEnds share one message), never a round trip of the client's. A node that does not watch (or
whose stream broke) gets the same changes with its next heartbeat, and nobody waits for it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterable

from kvpool.master.state import ManifestDelta, MasterState

# Changes nobody waits for (evictions by the master's tick) go out at least this often.
PUSH_INTERVAL_S = 0.5
# A put is never held longer than this by a node that is slow to take its changes: the
# changes stay queued for the node, the put answers, and only that window is at risk.
MAX_WAIT_S = 3.0


class _Watch:
    def __init__(self) -> None:
        self.wake = asyncio.Event()
        self.waiters: list[asyncio.Future] = []


class ManifestWatchers:
    """The open WatchManifest streams, by node id; all on the server's one event loop."""

    def __init__(self, state: MasterState) -> None:
        self._state = state
        self._watches: dict[str, _Watch] = {}
        self._watched: set[str] = set()
        self._closed = False

    def close(self) -> None:
        """End every stream (the master is stopping): each handler returns and its node's
        stream completes, instead of being cancelled by the server's stop mid-wait."""
        self._closed = True
        for watch in self._watches.values():
            watch.wake.set()

    def delivers(self, node_id: str) -> bool:
        """Whether this node's changes go by stream (it has watched once): then never by
        heartbeat too, where an older answer could overtake a newer stream message. While its
        stream is down they wait for it to come back (the node re-opens it within a second)."""
        return node_id in self._watched

    async def stream(self, node_id: str) -> AsyncIterator[ManifestDelta]:
        """The node's changes as they happen (the first at once: whatever is queued)."""
        watch = self._watches[node_id] = _Watch()
        self._watched.add(node_id)
        watch.wake.set()
        try:
            # First, an empty message: the node learns that its stream is open, i.e. that from
            # now on every put acknowledged on its segments waits for the node to be sent it.
            yield ManifestDelta([], [])
            while not self._closed:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(watch.wake.wait(), PUSH_INTERVAL_S)
                watch.wake.clear()
                waiters, watch.waiters = watch.waiters, []
                delta = self._state.take_manifest(node_id)
                if delta is not None and (delta.committed or delta.removed):
                    yield delta
                _release(waiters)
        finally:
            if self._watches.get(node_id) is watch:
                del self._watches[node_id]
            _release(watch.waiters)

    async def flush(self, node_ids: Iterable[str]) -> None:
        """Wait until the changes queued for these nodes were sent to their watchers."""
        loop = asyncio.get_running_loop()
        futures = []
        for node_id in node_ids:
            watch = self._watches.get(node_id)
            if watch is not None:
                f = loop.create_future()
                watch.waiters.append(f)
                watch.wake.set()
                futures.append(f)
        if futures:
            await asyncio.wait(futures, timeout=MAX_WAIT_S)


def _release(waiters: list[asyncio.Future]) -> None:
    for f in waiters:
        if not f.done():
            f.set_result(None)
