"""ManifestWatchers: a stream opens with an empty message; a flush returns once the node has
acknowledged the queued changes; what a broken stream left unacknowledged is sent again on the
next one; nobody waits for a node that does not watch."""

from __future__ import annotations

import asyncio

from kvpool.master.manifest_watch import ManifestWatchers

from .test_state import make_state
from .test_state_recovery import mount, put


def watched(clock):
    state = make_state(clock)
    mount(state, "n1", "s1", keeps_manifest=True)
    return state, ManifestWatchers(state)


async def consume(stream, sent: list) -> None:
    async for seq, delta in stream:
        sent.append((seq, [r.key for r in delta.committed]))


async def open_stream(watchers, sink: list, reader=None, node: str = "n1"):
    """A stream of ``node`` and the task reading it into ``sink`` (or ``reader``'s task)."""
    stream = watchers.stream(node)
    task = asyncio.create_task(reader(stream) if reader else consume(stream, sink))
    await asyncio.sleep(0)
    return stream, task


async def close_stream(stream, task) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await stream.aclose()


async def flush_waits_for_the_next_stream(state, watchers, key: str, seq: int) -> None:
    """Put ``key`` while n1 has no stream open: the flush waits, the next stream sends the
    change (after its empty "open" message) and only the node's ack of it releases the flush."""
    put(state, key, crc=seq)
    flush = asyncio.create_task(watchers.flush(state.nodes_with_changes()))
    await asyncio.sleep(0.05)
    assert not flush.done()
    sent: list = []
    stream, task = await open_stream(watchers, sent)
    await asyncio.sleep(0.05)
    assert sent == [(0, []), (seq, [key])] and not flush.done()
    watchers.ack("n1", seq)
    await asyncio.wait_for(flush, 0.5)
    await close_stream(stream, task)


def test_flush_waits_until_the_node_has_applied_the_changes(clock):
    state, watchers = watched(clock)
    sent: list = []

    async def main():
        stream = watchers.stream("n1")
        task = asyncio.create_task(consume(stream, sent))
        await asyncio.sleep(0)                # the stream registers
        put(state, "a", crc=1)
        flush = asyncio.create_task(watchers.flush(state.nodes_with_changes()))
        await asyncio.sleep(0.05)
        assert sent == [(0, []), (1, ["a"])]  # "open" first, then the change: sent...
        assert not flush.done()               # ...but not applied yet
        watchers.ack("n1", 1)
        await asyncio.wait_for(flush, 0.5)
        assert watchers.delivers("n1")
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await stream.aclose()
        # The stream is gone: the change stays queued, and a flush waits for the next stream.
        await flush_waits_for_the_next_stream(state, watchers, "b", 2)

    asyncio.run(main())


def test_a_node_that_will_watch_is_waited_for_before_its_first_stream(clock):
    """A node just mounted (started, or re-mounted after a master restart) takes puts before
    its stream is open: their commits wait for that stream, not for nothing."""
    state, watchers = watched(clock)
    watchers.expect("n1")
    asyncio.run(flush_waits_for_the_next_stream(state, watchers, "a", 1))


def test_nobody_waits_for_a_silent_node_without_a_stream_or_one_that_does_not_watch(clock):
    state, watchers = watched(clock)
    mount(state, "n2", "s2", keeps_manifest=True)
    watchers.expect("n2")

    async def main():
        put(state, "a", crc=1)               # n1: mounted with a manifest, but never watches
        await asyncio.wait_for(watchers.flush(state.nodes_with_changes()), 0.5)
        clock.advance(state.config.node_ttl_s / 2)
        state.heartbeat("n1", take_manifest=False)
        put(state, "b", crc=2, replicas=2)   # n2: will watch, but silent for a while now
        assert sorted(state.nodes_with_changes()) == ["n1", "n2"]
        await asyncio.wait_for(watchers.flush(state.nodes_with_changes()), 0.5)
        # A silent node whose stream is open is alive, only slow: it is waited for.
        sent: list = []
        stream, task = await open_stream(watchers, sent, node="n2")
        put(state, "c", crc=3, replicas=2)
        flush = asyncio.create_task(watchers.flush(state.nodes_with_changes()))
        await asyncio.sleep(0.05)
        # "b" (queued before the stream opened) and "c" go in one message or two.
        assert sent[0] == (0, []) and [k for _, keys in sent[1:] for k in keys] == ["b", "c"]
        assert not flush.done()
        watchers.ack("n2", sent[-1][0])
        await asyncio.wait_for(flush, 0.5)
        await close_stream(stream, task)

    asyncio.run(main())


def test_what_a_broken_stream_left_unacknowledged_is_sent_again(clock):
    """A master whose stream write never reached the node (the stream broke) must not count
    the commit as delivered: it goes again, first, on the node's next stream, and the put
    still waiting is released only by that stream's acknowledgement."""
    state, watchers = watched(clock)
    first: list = []
    second: list = []

    async def main():
        stream = watchers.stream("n1")
        task = asyncio.create_task(consume(stream, first))
        await asyncio.sleep(0)
        put(state, "a", crc=1)
        flush = asyncio.create_task(watchers.flush(state.nodes_with_changes()))
        await asyncio.sleep(0.05)
        assert first == [(0, []), (1, ["a"])]
        task.cancel()                          # broken before the node acknowledged
        await asyncio.gather(task, return_exceptions=True)
        await stream.aclose()
        put(state, "b", crc=2)                 # queued behind the resent "a"
        assert not flush.done()
        again = watchers.stream("n1")
        task = asyncio.create_task(consume(again, second))
        await asyncio.sleep(0.05)
        assert second == [(0, []), (2, ["a", "b"])]   # seqs go on across streams...
        watchers.ack("n1", 1)                        # ...so a late ack of the broken one
        await asyncio.sleep(0.05)
        assert not flush.done()                      # releases nothing here
        watchers.ack("n1", 2)
        await asyncio.wait_for(flush, 0.5)
        await close_stream(again, task)

    asyncio.run(main())


def test_a_stream_replaced_by_a_newer_one_takes_no_more_changes(clock):
    """The node opened a new stream before the master noticed the old one end: the old one
    must not take the node's changes (they would go down a dead stream while the new stream,
    finding nothing queued, released the put waiting for them)."""
    state, watchers = watched(clock)
    old_sent: list = []
    new_sent: list = []

    async def main():
        old, old_task = await open_stream(watchers, old_sent)
        new, new_task = await open_stream(watchers, new_sent)
        put(state, "a", crc=1)
        flush = asyncio.create_task(watchers.flush(state.nodes_with_changes()))
        await asyncio.sleep(0.6)              # past PUSH_INTERVAL_S: the old one woke too
        assert old_sent == [(0, [])] and old_task.done()
        assert new_sent == [(0, []), (1, ["a"])] and not flush.done()
        watchers.ack("n1", 1)
        await asyncio.wait_for(flush, 0.5)
        await close_stream(new, new_task)
        await close_stream(old, old_task)

    asyncio.run(main())


def test_what_a_replaced_stream_left_unacknowledged_goes_before_anything_newer(clock):
    """The node reconnected while its old stream still held the commit of "a" unacknowledged
    (perhaps applied). "a" is then removed. The new stream must send that commit before the
    removal, never after it (the node would hold "a" again, over space reused by others)."""
    state, watchers = watched(clock)
    old_sent: list = []
    applied: list = []   # what the node applies, in order

    async def node(stream):
        async for seq, delta in stream:
            applied.extend([("commit", r.key) for r in delta.committed]
                           + [("remove", k) for k, _ in delta.removed])
            if seq:
                watchers.ack("n1", seq)

    async def main():
        old, old_task = await open_stream(watchers, old_sent)
        put(state, "a", crc=1)
        flush = asyncio.create_task(watchers.flush(state.nodes_with_changes()))
        await asyncio.sleep(0.05)
        assert old_sent == [(0, []), (1, ["a"])]     # sent, never acknowledged
        new, new_task = await open_stream(watchers, applied, node)
        await asyncio.sleep(0.05)
        assert state.remove(["a"]) == [None]
        await asyncio.wait_for(watchers.flush(state.nodes_with_changes()), 0.5)
        await asyncio.wait_for(flush, 0.5)
        await asyncio.sleep(0.6)                      # the old stream wakes, and ends
        assert applied == [("commit", "a"), ("remove", "a")]
        await close_stream(new, new_task)
        await close_stream(old, old_task)

    asyncio.run(main())
