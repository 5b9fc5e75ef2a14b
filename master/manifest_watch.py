"""Pushes manifest changes to the store nodes that watch them, and lets RPCs wait for that.

A PutEnd answers only after the nodes holding the committed objects have applied the commit (they
acknowledge each message by its seq), so a master killed right after answering loses nothing it
acknowledged: the nodes re-announce it. A PutStart answers only after the removals of the
objects it evicted were applied (otherwise a master killed while the new object's bytes are
being written over the evicted one's would leave that one in a manifest, and a restarted master
would serve it with the new bytes), and after the nodes recorded the reservation of the new
extents (a restarted master keeps them out of reuse while the writer may still write there).
The wait costs a stream write and the node's acknowledgement (a local round trip, shared by
concurrent calls), never a round trip of the client's.

A node that keeps a manifest watches its changes (it says so when it mounts), so its changes
go only by stream, and an RPC waits for them while the stream is down too: before the node's
first stream (a node just started or re-mounted), or between two. Only the node's newest
stream takes its changes. Messages a stream sent but the node never acknowledged (the stream
broke, or a newer one replaced it) go back to the front of the node's queue, before anything
newer, and their waiters, with those that came while no stream was open, to the node's next
stream. A node that does not watch gets the same changes with its next heartbeat, and nobody
waits for it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterable

from kvpool.master.manifest_log import ManifestDelta
from kvpool.master.state import MasterState

# Changes nobody waits for (evictions by the master's tick) go out at least this often.
PUSH_INTERVAL_S = 0.5
# Changes that only confirm what a node holds (a fenced or sealed put's commit) go out this soon,
# one message for all made meanwhile: the node's shm index (net/shm_index.py) serves an object
# to same-host readers only once its commit arrived (a get before that asks the master).
PUSH_SOON_S = 0.05
# A put is never held longer than this by a node that is slow to take its changes: the
# changes stay queued for the node, the put answers, and only that window is at risk.
MAX_WAIT_S = 3.0


class _Watch:
    def __init__(self, waiters: list[asyncio.Future]) -> None:
        self.wake = asyncio.Event()
        self.soon = False   # a push_soon is due
        self.waiters = waiters   # for the changes queued now: released by the next ack
        # seq -> the message sent and who waits for the node to apply it
        self.unacked: dict[int, tuple[ManifestDelta, list[asyncio.Future]]] = {}


class ManifestWatchers:
    """The open WatchManifest streams, by node id; all on the server's one event loop."""

    def __init__(self, state: MasterState) -> None:
        self._state = state
        self._watches: dict[str, _Watch] = {}
        self._watched: set[str] = set()
        # Waiters of a stream that ended before the node acknowledged: the next one takes them.
        self._orphans: dict[str, list[asyncio.Future]] = {}
        # The last seq sent to each node, across its streams: an acknowledgement of a broken
        # stream's message that arrives late can never release a newer stream's waiters.
        self._seqs: dict[str, int] = {}
        self._closed = False
        # Calls answered without every node's acknowledgement (MAX_WAIT_S ran out): each is
        # a window in which a master killed at once loses what the call changed.
        self.wait_timeouts = 0

    def unacked(self) -> dict[str, int]:
        """Messages sent on each open stream and not acknowledged yet (the node's lag)."""
        return {node_id: len(w.unacked) for node_id, w in self._watches.items()}

    def close(self) -> None:
        """End every stream (the master is stopping): each handler returns and its node's
        stream completes, instead of being cancelled by the server's stop mid-wait."""
        self._closed = True
        for watch in self._watches.values():
            watch.wake.set()
        for waiters in self._orphans.values():
            _release(waiters)
        self._orphans.clear()

    def expect(self, node_id: str) -> None:
        """This node will watch (it keeps a manifest): from now on its changes wait for its
        stream, even before it first opens one."""
        self._watched.add(node_id)

    def delivers(self, node_id: str) -> bool:
        """Whether this node's changes go by stream (it watches, or said it will): then never
        by heartbeat too, where an older answer could overtake a newer stream message. While
        its stream is down they wait for it to come back (the node re-opens it within a
        second)."""
        return node_id in self._watched

    async def stream(self, node_id: str) -> AsyncIterator[tuple[int, ManifestDelta]]:
        """The node's changes as they happen (the first at once: whatever is queued), each
        with the seq the node acknowledges (:meth:`ack`) once it has applied it."""
        old = self._watches.pop(node_id, None)
        if old is not None:
            # The node's previous stream (its end not noticed yet) is replaced now: what it
            # sent unacknowledged goes first on this one, before anything newer. Requeued
            # later, when that stream's handler ends, it would overtake newer changes (an old
            # commit re-applied after its removal, or over the object that took its place).
            self._requeue(node_id, old)
        watch = self._watches[node_id] = _Watch(self._orphans.pop(node_id, []))
        self._watched.add(node_id)
        watch.wake.set()
        try:
            # First, an empty message: the node learns that its stream is open, i.e. that from
            # now on every put acknowledged on its segments waits for the node to apply it.
            yield 0, ManifestDelta([], [])
            while not self._closed:
                # asyncio.timeout, not wait_for: no task made per message (on every put's path)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(PUSH_INTERVAL_S):
                        await watch.wake.wait()
                if self._watches.get(node_id) is not watch:
                    # A newer stream of this node took over (this one's end is not noticed
                    # yet): only that one may take the node's changes, or its waiters would
                    # be released for changes that went down a dead stream.
                    break
                watch.wake.clear()
                waiters, watch.waiters = watch.waiters, []
                delta = self._state.take_manifest(node_id)
                if delta is None or not (delta.committed or delta.removed or delta.reserved):
                    _release(waiters)   # nothing queued for them: nothing to wait for
                    continue
                seq = self._seqs[node_id] = self._seqs.get(node_id, 0) + 1
                watch.unacked[seq] = (delta, waiters)
                yield seq, delta
        finally:
            if self._watches.get(node_id) is watch:
                del self._watches[node_id]
            self._requeue(node_id, watch)

    def removals_outstanding(self) -> bool:
        """Whether a removal was queued or sent and not acknowledged yet by its node: until it
        is, a put answered without waiting could leave a restarted master both the removed
        object (still in a manifest) and its successor."""
        return self._state.removals_queued() or any(
            delta.removed for w in self._watches.values() for delta, _ in w.unacked.values())

    def ack(self, node_id: str, seq: int) -> None:
        """The node has applied every message of its stream up to ``seq``."""
        watch = self._watches.get(node_id)
        if watch is None:
            return
        for s in [s for s in watch.unacked if s <= seq]:
            _release(watch.unacked.pop(s)[1])

    def _requeue(self, node_id: str, watch: _Watch) -> None:
        """A stream ended: what it sent unacknowledged goes back to the front of the node's
        queue (applying a message twice is harmless), its waiters to the next stream, which a
        live node opens within a second (they give up after MAX_WAIT_S)."""
        waiters, watch.waiters = list(watch.waiters), []
        for seq in sorted(watch.unacked, reverse=True):   # the oldest ends up first
            delta, held = watch.unacked.pop(seq)
            self._state.requeue_manifest(node_id, delta)
            waiters += held
        waiters = [f for f in waiters if not f.done()]
        current = self._watches.get(node_id)
        if self._closed:
            _release(waiters)
        elif current is not None:   # a newer stream is open already: it sends them
            current.waiters += waiters
            current.wake.set()
        elif waiters:
            orphans = self._orphans.setdefault(node_id, [])
            orphans[:] = [f for f in orphans if not f.done()] + waiters

    def push(self, node_ids: Iterable[str]) -> None:
        """Send the changes queued for these nodes on their open streams now, waiting for
        nobody (a node with no stream open gets them when it opens one)."""
        for node_id in node_ids:
            watch = self._watches.get(node_id)
            if watch is not None:
                watch.wake.set()

    def push_soon(self, node_ids: Iterable[str]) -> None:
        """:meth:`push` in ``PUSH_SOON_S``, once for every call that asks meanwhile."""
        for node_id in node_ids:
            watch = self._watches.get(node_id)
            if watch is not None and not watch.soon:
                watch.soon = True
                asyncio.get_running_loop().call_later(PUSH_SOON_S, _push_now, watch)

    async def flush(self, node_ids: Iterable[str]) -> None:
        """Wait until the changes queued for these nodes were applied by their watchers, on
        the open stream or the next one (MAX_WAIT_S at most: a node slow to take its changes
        does not hold puts longer). Not waited for: nodes that do not watch, and those with
        no stream open that have gone silent (probably dead: a stalled node keeps its stream)."""
        loop = asyncio.get_running_loop()
        futures = []
        for node_id in node_ids:
            watch = self._watches.get(node_id)
            if watch is None and (self._closed or node_id not in self._watched
                                  or not self._state.heard_from(node_id)):
                continue
            f = loop.create_future()
            futures.append(f)
            if watch is not None:
                watch.waiters.append(f)
                watch.wake.set()
            else:
                orphans = self._orphans.setdefault(node_id, [])
                orphans[:] = [o for o in orphans if not o.done()] + [f]
        if futures:
            _, late = await asyncio.wait(futures, timeout=MAX_WAIT_S)
            self.wait_timeouts += bool(late)
            for f in futures:
                f.cancel()   # given up on (done ones are unaffected): no longer held anywhere


def _release(waiters: list[asyncio.Future]) -> None:
    for f in waiters:
        if not f.done():
            f.set_result(None)


def _push_now(watch: _Watch) -> None:
    watch.soon = False
    watch.wake.set()
