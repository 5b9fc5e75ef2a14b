"""The Router service in a real master process: registration, token blocks, events, Route."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
from kvpool.client import KVClient
from kvpool.client.blocks import TokenBlocks
from kvpool.client.router import Candidate, RouterClient
from kvpool.common.errors import HashSpecMismatch, InvalidArgument
from kvpool.common.hashing import HashSpec
from kvpool.common.kv_events import BlockRemoved, BlockStored

BS = 16


def kv_of(key_index: int, nbytes: int = 4096) -> np.ndarray:
    return np.full(nbytes, key_index % 251, dtype=np.uint8)


def test_token_blocks_put_find_and_read_a_prefix(cluster):
    spec = HashSpec.of(BS, model="m")
    prompt = list(range(1000, 1000 + 5 * BS + 3))       # 5 full blocks and 3 tokens
    with KVClient(cluster.master) as kv:
        blocks = TokenBlocks(kv, spec)
        assert blocks.cached_prefix(prompt) == 0
        assert blocks.put(prompt, [kv_of(i) for i in range(3)]) == [None] * 3
        assert blocks.cached_prefix(prompt) == 3
        # A second prompt sharing 2 blocks: its third differs, so only 2 are cached for it.
        other = prompt[:2 * BS] + [7] * (3 * BS)
        assert blocks.cached_prefix(other) == 2
        # Putting what another instance already stored is fine (reported as done).
        assert blocks.put(other, [kv_of(i) for i in range(3)]) == [None] * 3
        out = [np.zeros(4096, np.uint8) for _ in range(3)]
        assert blocks.get_prefix(prompt, out) == 3
        assert all((o == i % 251).all() for i, o in enumerate(out))
        # A prefix read stops counting at the first missing block.
        kv.remove(blocks.keys(prompt)[1])
        assert blocks.get_prefix(prompt, out) == 1
        with pytest.raises(InvalidArgument, match="full blocks"):
            blocks.put(prompt, [kv_of(0)] * 6)


def test_a_client_with_another_block_size_is_refused(cluster):
    with RouterClient(cluster.master) as router:
        assert router.register(HashSpec(BS)).block_size == BS
        with pytest.raises(HashSpecMismatch, match="16-token blocks.*the client uses 32"):
            router.register(HashSpec(32))
    with KVClient(cluster.master) as kv, pytest.raises(HashSpecMismatch):
        TokenBlocks(kv, HashSpec(32))


def test_route_follows_events_and_the_store(cluster):
    spec = HashSpec.of(BS, model="m")
    prompt = list(range(4 * BS))
    hashes = spec.hashes(prompt)
    with RouterClient(cluster.master) as router, KVClient(cluster.master) as kv:
        router.register(spec)
        router.publish("engine-a", [BlockStored(tuple(hashes[:1]))])
        with router.event_stream("engine-b") as stream:
            stream.send([BlockStored(tuple(hashes[:3]))])
            stream.send([BlockRemoved(tuple(hashes[2:3]))])
        # Store blocks 0-2 in the pool: they count as the "store" tier everywhere.
        TokenBlocks(kv, spec).put(prompt, [kv_of(i) for i in range(3)])
        idle = [Candidate("engine-a"), Candidate("engine-b")]
        got = router.route(token_ids=prompt, extra_keys={"model": "m"}, candidates=idle,
                           policy="prefix_affinity")
        assert got.instance_id == "engine-b" and got.blocks == 4
        assert got.hits == {"gpu": 2, "cpu": 0, "store": 1}
        by_hash = router.route(block_hashes=hashes, candidates=idle)
        assert by_hash.instance_id == "engine-b" and by_hash.policy == "kvpool"
        # Without the model key the tokens hash to other blocks: nothing matches.
        cold = router.route(token_ids=prompt, candidates=idle, policy="prefix_affinity")
        assert cold.hits == {"gpu": 0, "cpu": 0, "store": 0}
        # A far busier engine-b loses to engine-a under the default policy.
        busy = [Candidate("engine-a"), Candidate("engine-b", 8, 200_000)]
        assert router.route(block_hashes=hashes, candidates=busy).instance_id == "engine-a"
        with pytest.raises(InvalidArgument, match="unknown routing policy"):
            router.route(block_hashes=hashes, policy="nope")


def test_route_weighs_each_candidates_measured_rates(cluster):
    """A gateway's calibrated rates travel in the candidates (over the lookup port after the
    first answer, gRPC before it) and the master's default policy judges each by its own."""
    spec = HashSpec.of(BS, model="m")
    hashes = spec.hashes(list(range(4 * BS)))
    with RouterClient(cluster.master) as router:
        router.register(spec)
        router.publish("engine-a", [BlockStored(tuple(hashes[:1]))])
        router.publish("engine-b", [BlockStored(tuple(hashes[:3]))])
        for _ in range(2):   # the second time on the lookup port
            same = [Candidate("engine-a", 1, 1000), Candidate("engine-b", 1, 1000)]
            assert router.route(block_hashes=hashes, candidates=same).instance_id == "engine-b"
            # engine-b measured at 100 prefill tokens/s: its 1,000 queued tokens take 10 s.
            slow_b = [Candidate("engine-a", 1, 1000),
                      Candidate("engine-b", 1, 1000, prefill_tokens_per_s=100.0)]
            got = router.route(block_hashes=hashes, candidates=slow_b)
            assert got.instance_id == "engine-a"
            assert got.estimated_ttft_s == pytest.approx((1000 + 3 * BS) / 8000, rel=0.05)
            with pytest.raises(InvalidArgument, match="rates"):
                router.route(block_hashes=hashes,
                             candidates=[Candidate("engine-a", store_tokens_per_s=-1.0)])


def test_silent_instances_age_out_of_a_running_master():
    import asyncio
    import threading

    from kvpool.common.config import MasterConfig
    from kvpool.master.server import MasterServer

    server = MasterServer(MasterConfig(node_ttl_s=0.5), port=0)
    server.routing.instance_ttl_s = 0.3
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    address = asyncio.run_coroutine_threadsafe(server.start(), loop).result(10)
    try:
        with RouterClient(address) as router:
            router.register(HashSpec(BS))
            router.publish("engine-a", [])
            assert router.route(block_hashes=[b"x" * 32]).instance_id == "engine-a"
            deadline = time.monotonic() + 10
            while "engine-a" in server.routing.instances() and time.monotonic() < deadline:
                time.sleep(0.05)
            with pytest.raises(InvalidArgument, match="no candidate"):
                router.route(block_hashes=[b"x" * 32])
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(0), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)


def test_route_async_answers_as_route_on_the_lookup_port_from_the_loop(cluster):
    """The gateway's Route: gRPC on a worker thread until an answer names the lookup port,
    then on the port from the event loop itself; answers and refusals as the blocking call's."""
    spec = HashSpec.of(BS, model="m")
    hashes = spec.hashes(list(range(4 * BS)))
    idle = [Candidate("engine-a"), Candidate("engine-b")]
    with RouterClient(cluster.master) as router:
        router.register(spec)
        router.publish("engine-b", [BlockStored(tuple(hashes[:3]))])
        expected = router.route(block_hashes=hashes, candidates=idle)
        assert expected.instance_id == "engine-b" and expected.hits["gpu"] == 3

    async def twice(r: RouterClient) -> list:
        got = [await r.route_async(block_hashes=hashes, candidates=idle) for _ in range(2)]
        with pytest.raises(InvalidArgument, match="unknown routing policy"):
            await r.route_async(block_hashes=hashes, policy="nope")
        return got

    with RouterClient(cluster.master) as fresh:   # knows no port yet: gRPC first
        assert fresh._lookups.channel is None
        got = asyncio.run(twice(fresh))
        channel = fresh._lookups.channel
        assert channel is not None and channel._idle_async, \
            "the second Route did not go on the lookup port"
    assert got == [expected, expected]
