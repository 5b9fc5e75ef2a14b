"""kvpool.compat.mooncake against a real cluster: every method, its return codes and error paths,
with the conventions of Mooncake's own client (mooncake-transfer-engine 0.3.13, checked by hand
against a real Mooncake master: a second put of a key returns 0 and keeps the first value, a
missing key reads as b"", a buffer too small is INVALID_PARAMS, ...)."""

from __future__ import annotations

import numpy as np
import pytest
from kvpool.client import KVClient
from kvpool.compat.mooncake import (
    BufferHandle,
    ErrorCode,
    MooncakeDistributedStore,
    ReplicateConfig,
    parse_size,
)
from kvpool.embedded import ContributingClient

OK = 0
NOT_FOUND = int(ErrorCode.OBJECT_NOT_FOUND)   # -704
INVALID = int(ErrorCode.INVALID_PARAMS)       # -600
NO_SPACE = int(ErrorCode.NO_AVAILABLE_HANDLE)  # -200
NOT_SET_UP = int(ErrorCode.ILLEGAL_CLIENT)    # -601


def test_the_error_codes_are_mooncakes_numbers():
    # mooncake-store/include/types.h, enum class ErrorCode
    assert {c.name: int(c) for c in ErrorCode} == {
        "OK": 0, "INTERNAL_ERROR": -1, "NO_AVAILABLE_HANDLE": -200, "INVALID_KEY": -400,
        "INVALID_PARAMS": -600, "ILLEGAL_CLIENT": -601, "INVALID_READ": -701,
        "OBJECT_NOT_FOUND": -704, "OBJECT_ALREADY_EXISTS": -705, "TRANSFER_FAIL": -800,
        "RPC_FAIL": -900}


def test_sizes_read_as_mooncake_reads_them():
    assert parse_size(4096) == parse_size("4096") == 4096
    assert parse_size("4GB") == parse_size("4gb") == parse_size("4GiB") == 4 << 30
    assert parse_size("512MB") == 512 << 20 and parse_size("0") == 0
    for bad in ("-1", "4 parsecs", "", True):
        with pytest.raises(ValueError):
            parse_size(bad)


def test_setup_in_both_forms_and_its_refusals(cluster):
    c = cluster()
    s = MooncakeDistributedStore()
    assert s.put("k", b"v") == NOT_SET_UP and s.get("k") == b"" and s.health_check() == 1
    with pytest.raises(TypeError):
        s.setup("127.0.0.1", "P2PHANDSHAKE")   # pybind11 raises TypeError too
    with pytest.raises(TypeError):
        s.setup("127.0.0.1", "x", 0, 0, "tcp", "", c.master, no_such_option=1)
    assert s.setup("127.0.0.1", "x", "many", 0, "tcp", "", c.master) == INVALID
    assert s.setup("127.0.0.1", "x", 0, 0, "tcp", "", c.master, tenant_id="t2") == INVALID
    assert s.setup("127.0.0.1", "x", 0, 0, "tcp", "", c.master,
                   enable_ssd_offload=True) == INVALID
    assert s.setup("127.0.0.1", "x", 0, 0, "tcp", "", "127.0.0.1:1") == int(ErrorCode.RPC_FAIL)
    # The metadata server is accepted and unused; the positional form works.
    assert s.setup("127.0.0.1", "http://nowhere:1/metadata", 0, 0, "rdma", "mlx5_0",
                   c.master) == OK
    assert s.health_check() == 0 and s.get_hostname() == "127.0.0.1"
    assert s.setup("127.0.0.1", "x", 0, 0, "tcp", "", c.master) == INVALID   # once only
    assert s.put("k", b"v") == OK
    assert s.close() == OK and s.close() == OK
    assert s.put("k2", b"v") == NOT_SET_UP and s.get("k") == b"" and s.health_check() == 1

    # The dict form, values as strings, LMCache's spelling of the master's key.
    d = MooncakeDistributedStore()
    assert d.setup({"local_hostname": "localhost", "metadata_server": "P2PHANDSHAKE",
                    "global_segment_size": "0", "local_buffer_size": "1GB",
                    "protocol": "tcp", "master_server_address": c.master}) == OK
    assert d.get("k") == b"v"
    d.close()
    assert MooncakeDistributedStore().setup({"local_hostname": "x"}) == INVALID   # no master


def test_put_get_and_mooncakes_looser_put(cluster, store):
    s = store(cluster().master)
    assert s.put("a", b"hello") == OK
    assert s.put("a", b"other") == OK   # Mooncake: 0, and the first value stays
    assert s.get("a") == b"hello"
    assert s.get("missing") == b""
    assert s.put("empty", b"") == INVALID
    assert s.put("", b"x") == INVALID
    assert s.put("np", np.arange(10, dtype=np.uint8)) == OK and s.get("np") == bytes(range(10))
    assert s.put_parts("parts", b"ab", memoryview(b"cd"), bytearray(b"e")) == OK
    assert s.get("parts") == b"abcde"
    assert s.get_size("a") == 5 and s.get_size("missing") == NOT_FOUND
    assert s.is_exist("a") == 1 and s.is_exist("missing") == 0
    assert s.batch_is_exist(["a", "missing", "parts"]) == [1, 0, 1]


def test_put_batch_get_batch_and_buffers(cluster, store):
    s = store(cluster().master)
    assert s.put_batch(["b1", "b2"], [b"1", b"22"]) == OK
    assert s.put_batch(["b1", "b3"], [b"x", b"333"]) == OK   # b1 stored: still 0
    assert s.put_batch(["b4", "b5"], [b"4", b""]) == INVALID   # the first error
    assert s.put_batch(["b6"], [b"1", b"2"]) == INVALID
    assert s.get_batch(["b1", "b2", "missing", "b3"]) == [b"1", b"22", b"", b"333"]
    handles = s.batch_get_buffer(["b3", "missing"])
    assert isinstance(handles[0], BufferHandle) and handles[1] is None
    assert handles[0].size() == 3 and bytes(memoryview(handles[0])) == b"333"
    assert handles[0].ptr() != 0
    assert s.get_buffer("missing") is None and s.get_buffer("b2") == b"22"


def test_remove_remove_all_and_batch_remove(cluster, store):
    c = cluster()
    s, other = store(c.master), store(c.master)
    assert other.put("theirs", b"t") == OK
    assert s.put_batch(["r1", "r2", "r3"], [b"1", b"2", b"3"]) == OK
    assert s.remove("r1") == OK and s.remove("r1") == NOT_FOUND
    assert s.get("r2") == b"2"
    # Mooncake refuses to remove an object just read (OBJECT_HAS_LEASE); kvpool removes it
    # and lets the reader finish.
    assert s.remove("r2") == OK
    assert s.batch_remove(["r3", "missing"]) == [OK, NOT_FOUND]
    assert s.put_batch(["r4", "r5"], [b"4", b"5"]) == OK
    other.remove("r5")
    # What this store put and is still there; never what other clients put.
    assert s.remove_all() == 1
    assert s.batch_is_exist(["r4", "theirs"]) == [0, 1]
    assert s.remove_all() == 0


def test_zero_copy_by_address_rows_and_scattered_buffers(cluster, store):
    s = store(cluster().master)
    src = np.random.default_rng(1).integers(0, 256, (8, 4096), dtype=np.uint8)
    assert s.register_buffer(src.ctypes.data, src.nbytes) == OK
    assert s.register_buffer(src.ctypes.data, src.nbytes) == INVALID   # already registered
    assert s.register_buffer(0, 10) == INVALID
    keys = [f"row{i}" for i in range(8)]
    # Back-to-back rows of one array (one 2-D view underneath), then scattered buffers.
    ptrs = [src.ctypes.data + i * 4096 for i in range(8)]
    assert s.batch_put_from(keys[:6], ptrs[:6], [4096] * 6) == [OK] * 6
    assert s.batch_put_from(keys[6:], [ptrs[7], ptrs[6]], [4096, 4096]) == [OK, OK]
    assert s.batch_put_from(keys[:2], ptrs[:2], [4096] * 2) == [OK, OK]   # stored: 0
    assert s.put_from("row0", ptrs[1], 4096) == OK and s.get("row0") == src[0].tobytes()
    assert s.batch_put_from(["z1", "z2"], [ptrs[0], 0], [16, 16]) == [OK, INVALID]
    assert s.batch_put_from(["z3"], ptrs[:2], [16]) == [INVALID]   # lengths differ

    dst = np.zeros((10, 4096), dtype=np.uint8)
    got = s.batch_get_into(keys + ["missing"], [dst.ctypes.data + i * 4096 for i in range(9)],
                           [4096] * 9)
    assert got == [4096] * 8 + [NOT_FOUND]
    assert (dst[:6] == src[:6]).all() and (dst[6] == src[7]).all() and (dst[7] == src[6]).all()
    assert s.get_into("row3", dst[9].ctypes.data, 4096) == 4096 and (dst[9] == src[3]).all()
    assert s.get_into("row3", dst[9].ctypes.data, 100) == INVALID   # does not fit
    assert s.get_into("missing", dst[9].ctypes.data, 4096) == NOT_FOUND
    assert s.batch_get_into(["row1", "row2"], [dst[9].ctypes.data, dst[8].ctypes.data],
                            [4096, 4096]) == [4096, 4096]   # scattered, out of order
    assert (dst[9] == src[1]).all() and (dst[8] == src[2]).all()
    assert s.batch_get_into(["row1"], [0], [4096]) == [INVALID]
    assert s.unregister_buffer(src.ctypes.data) == OK
    assert s.unregister_buffer(src.ctypes.data) == INVALID


def test_multi_buffer_puts_gather_and_gets_scatter(cluster, store):
    s = store(cluster().master)
    a, b = np.full(100, 1, np.uint8), np.full(50, 2, np.uint8)
    assert s.batch_put_from_multi_buffers(["mb"], [[a.ctypes.data, b.ctypes.data]],
                                          [[100, 50]]) == [OK]
    assert s.get("mb") == bytes(a) + bytes(b)
    x, y = np.zeros(100, np.uint8), np.zeros(50, np.uint8)
    assert s.batch_get_into_multi_buffers(["mb", "missing"],
                                          [[y.ctypes.data, x.ctypes.data], [x.ctypes.data]],
                                          [[50, 100], [100]]) == [150, NOT_FOUND]
    assert bytes(y) + bytes(x) == bytes(a) + bytes(b)
    assert s.batch_get_into_multi_buffers(["mb"], [[x.ctypes.data]], [[100]]) == [INVALID]


def test_tensors_keep_dtype_and_shape(cluster, store):
    torch = pytest.importorskip("torch")
    s = store(cluster().master)
    t = torch.arange(24, dtype=torch.bfloat16).reshape(2, 3, 4)
    assert s.put_tensor("t", t) == OK
    back = s.get_tensor("t")
    assert back.dtype == torch.bfloat16 and torch.equal(back, t)
    assert s.get_tensor("missing") is None
    assert s.get_tensor("t") is not None and s.put("raw", b"not a tensor") == OK
    assert s.get_tensor("raw") is None
    u = torch.ones(5, dtype=torch.float32)
    assert s.batch_put_tensor(["u", "t"], [u, t]) == [OK, OK]
    got = s.batch_get_tensor(["u", "missing"])
    assert torch.equal(got[0], u) and got[1] is None
    assert s.put_tensor("notensor", b"abc") == INVALID


def test_replicate_config_replicas_and_hard_pin(cluster, store):
    c = cluster(nodes=2)
    s = store(c.master)
    config = ReplicateConfig()
    config.replica_num, config.with_hard_pin = 2, True
    config.preferred_segment = "anything"   # accepted, unused
    assert s.put("two", b"x" * 1000, config) == OK
    with KVClient(c.master) as kv:
        segs = [seg for seg in kv.stats().segments if seg.objects]
    assert len(segs) == 2   # one copy on each node


def test_no_space_and_an_unreachable_node_return_mooncakes_codes(cluster, store):
    c = cluster(nodes=1, segment_size="4MiB")
    s = store(c.master)
    assert s.put("huge", b"x" * (8 << 20)) == NO_SPACE
    assert s.put("k", b"x" * 4096) == OK
    c.nodes[0].kill()
    assert s.get("k") == b""
    buf = np.zeros(4096, np.uint8)
    assert s.get_into("k", buf.ctypes.data, 4096) in (int(ErrorCode.TRANSFER_FAIL), NOT_FOUND)


def test_a_client_that_contributes_memory_serves_it_until_close(cluster, store):
    c = cluster(nodes=0)   # no store node: the only memory is the client's own
    with KVClient(c.master) as kv:
        assert len(kv.stats().segments) == 0
        s = store(c.master, segment="8MB")
        segs = kv.stats().segments
        assert [seg.segment.size_bytes for seg in segs] == [8 << 20]
        assert s.get_hostname() == segs[0].node.tcp_endpoint
        assert s.put("mine", b"m" * 10000) == OK
        assert kv.get("mine") == b"m" * 10000   # another client reads it from this process
        assert s.close() == OK
        assert len(kv.stats().segments) == 0 and not kv.exists("mine")   # gone with it


def test_contributing_client_is_a_kvpool_feature_without_the_compat_layer(cluster):
    c = cluster(nodes=0)
    with ContributingClient(c.master, host_bytes=4 << 20) as kv:
        assert kv.segment.size_bytes == 4 << 20 and kv.segment.tcp_endpoint
        kv.put("k", b"v" * 100)
        with KVClient(c.master, transports=["tcp"]) as other:
            assert other.get("k") == b"v" * 100   # over tcp from this process's segment
    with KVClient(c.master) as kv:
        assert len(kv.stats().segments) == 0
