"""ManifestWatchers: a stream opens with an empty message; a flush returns once the node's
stream has yielded the queued changes; nobody waits for a node that does not watch."""

from __future__ import annotations

import asyncio

from kvpool.master.manifest_watch import ManifestWatchers

from .test_state import make_state
from .test_state_recovery import mount, put


def test_flush_waits_for_the_stream_to_take_the_changes(clock):
    state = make_state(clock)
    mount(state, "n1", "s1", keeps_manifest=True)
    watchers = ManifestWatchers(state)
    sent = []

    async def main():
        stream = watchers.stream("n1")

        async def consume():
            async for delta in stream:
                sent.append([r.key for r in delta.committed])

        task = asyncio.create_task(consume())
        await asyncio.sleep(0)                # the stream registers
        put(state, "a", crc=1)
        await watchers.flush(state.nodes_with_changes())
        assert sent == [[], ["a"]]            # "open" first; the change before flush returned
        assert watchers.delivers("n1")
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await stream.aclose()
        # The stream is gone: a flush does not wait, the change stays queued for the node.
        put(state, "b", crc=2)
        await asyncio.wait_for(watchers.flush(state.nodes_with_changes()), 0.5)
        assert [r.key for r in state.take_manifest("n1").committed] == ["b"]

    asyncio.run(main())
