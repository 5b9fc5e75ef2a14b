"""Careless or hostile clients (issue 15, second table), against real processes: a put that
cannot fit evicts nothing, puts started and abandoned hold at most their share, every client
error is typed (never UNKNOWN with a traceback), and errors clients repeat are logged a few
times, not once per request."""

from __future__ import annotations

import math
import socket

import grpc
import numpy as np
import pytest
from kvpool.client import KVClient
from kvpool.client.kv_client import SLOT_BATCH_MAX
from kvpool.client.router import RouterClient
from kvpool.common.errors import InvalidArgument, LimitExceeded, NoSpace
from kvpool.common.kv_events import BlockRemoved, BlockStored
from kvpool.net.data_port import RESPONSE, FrameStatus, Op, encode_request
from kvpool.protos.kvpool.v1 import master_pb2 as pb
from kvpool.rpc.master_client import MasterClient

from .conftest import channel_to, run_cluster

MiB = 1 << 20


@pytest.fixture
def kv(cluster):
    with KVClient(cluster.master) as client:
        yield client


def raw_call(cluster, method: str):
    channel = channel_to(cluster)
    return channel, channel.unary_unary(f"/kvpool.v1.Master/{method}",
                                        request_serializer=lambda b: b,
                                        response_deserializer=lambda b: b)


def test_a_put_that_cannot_fit_beside_hard_pins_evicts_nothing(cluster, kv):
    # The numbers: 2 nodes of 64 MiB, 20 objects of 1 MiB, two hard pins of 31 MiB
    # (within the quota of 64 MiB), then a put of 40 MiB. Before: 20 objects evicted, and
    # NoSpace all the same. Now: NoSpace at once, saying why; nothing evicted.
    small = [f"small{i}" for i in range(20)]
    assert kv.batch_put(small, [np.full(MiB, i, np.uint8) for i in range(20)]) == [None] * 20
    kv.put("pin1", np.ones(31 * MiB, np.uint8), pin=True)
    kv.put("pin2", np.ones(31 * MiB, np.uint8), pin=True)
    with pytest.raises(NoSpace) as refused:
        kv.put("big", np.ones(40 * MiB, np.uint8))
    message = str(refused.value)
    assert "before evicting anything" in message and "65011712 pinned" in message, message
    assert "-" not in message.split("the cluster has", 1)[1].split("bytes free")[0]
    assert kv.batch_exists(small) == [True] * 20
    assert [kv.get(k)[0] for k in small] == list(range(20))
    with MasterClient(cluster.master) as mc:
        assert mc.stats().evictions == 0


def test_puts_started_and_abandoned_hold_at_most_their_share(cluster, kv):
    # PutStart of 2 x 63 MiB with no PutEnd: the second is refused (pending puts may hold half
    # the capacity); a legitimate put still goes, and nothing was wiped. A batch larger than
    # a slot batch: this client holds no slots (they count as puts started) when the hogs come.
    small = [f"small{i}" for i in range(SLOT_BATCH_MAX + 2)]
    assert kv.batch_put(small, [np.full(MiB // 4, i, np.uint8) for i in range(len(small))]
                        ) == [None] * len(small)
    with MasterClient(cluster.master) as mc:
        [first], _ = mc.put_start(["hog1"], [63 * MiB])
        assert isinstance(first, tuple)
        [second], _ = mc.put_start(["hog2"], [63 * MiB])
        assert isinstance(second, NoSpace) and "max_pending_fraction" in str(second), second
    kv.put("legit", np.ones(MiB // 2, np.uint8))
    assert kv.get("legit") == bytes(np.ones(MiB // 2, np.uint8))


def test_pin_ttl_nan_or_infinite_is_invalid_argument(cluster, kv):
    kv.put("x", b"x")
    for ttl in (math.nan, math.inf):
        with pytest.raises(InvalidArgument):
            kv.pin("x", ttl_s=ttl)
    channel, pin = raw_call(cluster, "Pin")
    with channel:
        for ttl in (math.nan, math.inf, -math.inf):
            with pytest.raises(grpc.RpcError) as e:
                pin(pb.PinRequest(keys=["x"], ttl_s=ttl).SerializeToString(), timeout=5)
            assert e.value.code() in (grpc.StatusCode.INVALID_ARGUMENT,), e.value.details()


# client/kv_client.py's fast path skips validate_key for short ASCII str keys only: a lone
# surrogate is caught per key there, not by protobuf for the whole batch.
def test_a_key_with_a_lone_surrogate_fails_only_its_own_slot_in_the_client(cluster, kv):
    bad = "kv/\ud800/0"
    results = kv.batch_put(["good1", bad, "good2"], [b"1", b"2", b"3"])
    assert results[0] is None and results[2] is None
    assert isinstance(results[1], InvalidArgument) and "UTF-8" in str(results[1])
    got = kv.batch_exists(["good1", "good2"])
    assert got == [True, True]
    for call in (lambda: kv.get(bad), lambda: kv.remove(bad), lambda: kv.pin(bad)):
        with pytest.raises(InvalidArgument):
            call()


def test_a_key_with_a_lone_surrogate_is_refused_by_the_master_and_validate_key(cluster, kv):
    from kvpool.common.types import validate_key
    with pytest.raises(InvalidArgument, match="UTF-8"):
        validate_key("kv/\ud800/0")
    # Raw gRPC: the bytes of a lone surrogate (CESU-8) are not UTF-8; refused, typed.
    body = pb.KeysRequest(keys=["placeholder"]).SerializeToString()
    body = body.replace(b"placeholder", b"kv/\xed\xa0\x80/01")
    for method in ("GetReplicas", "Exists", "Remove", "PutRevoke"):
        channel, call = raw_call(cluster, method)
        with channel, pytest.raises(grpc.RpcError) as e:
            call(body, timeout=5)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, e.value.details())


def test_oversized_values_and_batches_are_typed(cluster, kv):
    from kvpool.common.errors import ValueTooLarge
    with pytest.raises(ValueTooLarge):
        kv.put("huge", np.zeros(65 * MiB, np.uint8))
    with MasterClient(cluster.master) as mc:
        [r], _ = mc.put_start(["huge"], [1 << 62])
        assert isinstance(r, ValueTooLarge)
    channel, put_start = raw_call(cluster, "PutStart")
    with channel, pytest.raises(grpc.RpcError) as e:   # more keys than MAX_BATCH
        put_start(pb.PutStartRequest(keys=[f"k{i}" for i in range(65537)],
                                     sizes=[1] * 65537).SerializeToString(), timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_malformed_protobuf_is_invalid_argument_and_logged_a_few_times(cluster, tmp_path):
    channel, get = raw_call(cluster, "GetReplicas")
    with channel:
        for _ in range(200):
            with pytest.raises(grpc.RpcError) as e:
                get(b"\xff\xff\xff\xff", timeout=5)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    log = (tmp_path / "logs" / "master.log").read_text()
    assert "Traceback" not in log
    assert 1 <= log.count("malformed_request") <= 10


def test_repeated_out_of_range_reads_are_logged_a_few_times(cluster, kv, tmp_path):
    # 5,000 reads past a segment's end: each refused, typed; a few log lines, not 5,000.
    kv.put("sentinel", b"still here")
    with MasterClient(cluster.master) as mc:
        [view] = mc.locate(["sentinel"]).views()
    r = view.replicas[0]
    host, _, port = r.node.tcp_endpoint.rpartition(":")
    request = encode_request(Op.READ, r.extent.segment_id, 64 * MiB - 10, 100)
    with socket.create_connection((host, int(port)), timeout=10) as s, \
            s.makefile("rb") as replies:
        for _ in range(10):   # pipelined, 500 a round trip
            s.sendall(request * 500)
            for _ in range(500):
                status, n = RESPONSE.unpack(replies.read(RESPONSE.size))
                assert status == FrameStatus.OUT_OF_BOUNDS
                replies.read(n)
    assert kv.get("sentinel") == b"still here"
    refused = sum(p.read_text().count("request_refused")
                  for p in (tmp_path / "logs").glob("node*.log"))
    assert 1 <= refused <= 10, refused


def test_fake_kv_events_cannot_grow_the_routing_index_without_bound(tmp_path):
    # The issue: 2M fake hashes grew the master by 200 MiB in 1.7 s, and 20,000 ghost
    # instances were indexed. Now blocks past the caps are dropped (and counted), and an
    # instance past the limit is refused with a typed error naming the flag.
    gen = run_cluster(tmp_path, nodes=1, master_args=[
        "--max-routing-instances", "4", "--max-routing-blocks-per-instance", "5000",
        "--max-routing-blocks", "12000"])
    cluster = next(gen)

    def hashes(lo: int, hi: int) -> tuple[bytes, ...]:
        return tuple(h.to_bytes(8, "big") for h in range(lo, hi))
    try:
        with RouterClient(cluster.master) as router:
            for i in range(4):
                fake = hashes(i * 100_000, i * 100_000 + 20_000)
                assert router.publish(f"ghost{i}", [BlockStored(fake)]) == 1
            with pytest.raises(LimitExceeded, match="--max-routing-instances"):
                router.publish("ghost4", [])
            held = {v.instance_id: v.gpu_blocks for v in router.list_instances()}
            assert held == {"ghost0": 5000, "ghost1": 5000, "ghost2": 2000, "ghost3": 0}
            router.publish("ghost0", [BlockRemoved(hashes(0, 1000))])   # room comes back
            router.publish("ghost3", [BlockStored(hashes(300_000, 300_050))])
            assert {v.instance_id: v.gpu_blocks for v in router.list_instances()}["ghost3"] == 50
    finally:
        gen.close()
