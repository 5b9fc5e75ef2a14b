"""The data path against careless and hostile same-host clients (issue 15), on real processes:
idle connections, the shm hand-off's trust, and the byte ranges a client may touch."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest
from kvpool.client import KVClient
from kvpool.rpc.master_client import MasterClient

from .conftest import run_cluster

MiB = 1 << 20
MAX_CONNECTIONS = 256
IDLE_TIMEOUT_S = 3.0


@pytest.fixture
def capped(tmp_path):
    """A cluster whose nodes take at most MAX_CONNECTIONS data connections, idle for at most
    IDLE_TIMEOUT_S."""
    yield from run_cluster(tmp_path, node_args=["--max-connections", str(MAX_CONNECTIONS),
                                                "--idle-timeout", f"{IDLE_TIMEOUT_S}s"])


def _proc(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _tcp_endpoint(master: str) -> tuple[str, int]:
    with MasterClient(master) as mc:
        nodes = {r.node.tcp_endpoint for v in mc.locate(["seed"]).views() for r in v.replicas}
    host, _, port = min(nodes).rpartition(":")
    return host, int(port)


@pytest.mark.parametrize("scheme", ["tcp", "shm"])
def test_idle_connections_cost_no_thread_and_lock_no_client_out(capped, scheme):
    """8 x the cap of idle tcp connections to a node: no thread each, the fd limit is never
    near, a client still puts and gets (tcp and shm), and idle ones go after the timeout."""
    with KVClient(capped.master, replicas=2) as kv:
        kv.put("seed", b"x" * 4096)
    host, port = _tcp_endpoint(capped.master)
    pid = next(p for p in capped.nodes if f"tcp={host}:{port}" in p.ready).popen.pid
    threads_before, fds_before = _proc(pid, "Threads"), _fds(pid)
    idle = []
    try:
        for _ in range(8 * MAX_CONNECTIONS):
            idle.append(socket.create_connection((host, port), timeout=10))
        time.sleep(0.5)
        # Not a thread per connection, and never past the cap: the node keeps its fds.
        assert _proc(pid, "Threads") < threads_before + 16
        assert _fds(pid) <= fds_before + MAX_CONNECTIONS + 4
        with KVClient(capped.master, transports=[scheme], replicas=2) as kv:
            for i in range(20):
                kv.put(f"k{i}", bytes([i]) * (64 << 10))
            for i in range(20):
                assert kv.get(f"k{i}") == bytes([i]) * (64 << 10)
        # The idle ones are closed after the timeout: each sees EOF.
        time.sleep(IDLE_TIMEOUT_S + 1.5)
        survivors = idle[-MAX_CONNECTIONS // 2:]
        for s in survivors:
            s.settimeout(5)
            assert s.recv(1) == b""
        assert _fds(pid) <= fds_before + 8
    finally:
        for s in idle:
            s.close()


# ---------------------------------------------------------------- shm trust

# Run as uid 65534 by Debian's python (stdlib only: kvpool's interpreter may not be readable by
# nobody): ask a node for a segment's fd over its hand-off socket, then try to write through
# whatever came back. Prints what happened as JSON.
_NOBODY = r'''
import json, mmap, os, socket, struct, sys
endpoint, sid, offset, writable = sys.argv[1], sys.argv[2].encode(), int(sys.argv[3]), sys.argv[4] == "1"
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect("\0" + endpoint)
s.sendall(struct.pack("!H", len(sid) | (0x8000 if writable else 0)) + sid)
data, fds, _, _ = socket.recv_fds(s, 12, 1)
while len(data) < 12:
    data += s.recv(12 - len(data))
status, n = struct.unpack("!B3xQ", data)
out = {"uid": os.getuid(), "status": status, "fds": len(fds), "message": ""}
if fds:
    fd = fds[0]
    out["fd_mode"] = os.stat(f"/proc/self/fd/{fd}").st_mode & 0o777
    try:
        mm = mmap.mmap(fd, n, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        mm[offset:offset + 4] = b"EVIL"
        out["wrote"] = "mapping"
    except OSError as e:
        out["rw_map"] = e.errno
    for flags in (os.O_RDWR, os.O_WRONLY):
        try:
            w = os.open(f"/proc/self/fd/{fd}", flags)
            os.pwrite(w, b"EVIL", offset)
            out["wrote"] = "reopen"
        except OSError as e:
            out.setdefault("reopen", e.errno)
    ro = mmap.mmap(fd, n, mmap.MAP_SHARED, mmap.PROT_READ)
    out["read"] = ro[offset:offset + 4].hex()
else:
    out["message"] = s.recv(4096).decode("utf-8", "replace")
print(json.dumps(out))
'''
_DEBIAN_PYTHON = "/usr/bin/python3"


def _as_nobody(endpoint: str, segment_id: str, offset: int, writable: bool) -> dict:
    import json
    import subprocess

    def drop() -> None:
        os.setgroups([])
        os.setgid(65534)
        os.setuid(65534)

    out = subprocess.run([_DEBIAN_PYTHON, "-c", _NOBODY, endpoint, segment_id, str(offset),
                          "1" if writable else "0"], preexec_fn=drop, capture_output=True,
                         text=True, timeout=30, check=True)
    return json.loads(out.stdout)


def _shm_replica(master: str, key: str):
    with MasterClient(master) as mc:
        [view] = mc.locate([key]).views()
    return view.replicas[0]


needs_root = pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists(_DEBIAN_PYTHON),
                                reason="runs a child as uid 65534: needs root and "
                                       f"{_DEBIAN_PYTHON}")


@needs_root
@pytest.mark.parametrize("writable", [False, True])
def test_shm_hand_off_to_an_untrusted_uid_is_refused(cluster, writable):
    with KVClient(cluster.master, replicas=1) as kv:
        kv.put("owned", b"good" * 1024)
        r = _shm_replica(cluster.master, "owned")
        got = _as_nobody(r.node.shm_endpoint, r.extent.segment_id, r.extent.offset, writable)
        assert got["uid"] == 65534
        assert got["fds"] == 0 and got["status"] == 7, got   # DENIED, no fd
        assert "does not trust" in got["message"]
        assert kv.get("owned", verify=True) == b"good" * 1024


@pytest.fixture
def nobody_reads(tmp_path):
    """A cluster whose nodes hand uid 65534 read-only fds."""
    yield from run_cluster(tmp_path, nodes=1, node_args=["--shm-reader", "uid:65534"])


@needs_root
def test_a_read_only_hand_off_cannot_poison_an_object(nobody_reads):
    with KVClient(nobody_reads.master, replicas=1) as kv:
        kv.put("owned", b"good" * 1024)
        r = _shm_replica(nobody_reads.master, "owned")
        got = _as_nobody(r.node.shm_endpoint, r.extent.segment_id, r.extent.offset, False)
        assert got["fds"] == 1 and got["status"] == 0, got
        assert "wrote" not in got, got
        assert got["rw_map"] == 13 and got["reopen"] == 13   # EACCES both ways
        assert got["fd_mode"] & 0o066 == 0, oct(got["fd_mode"])   # owner-only inode
        assert bytes.fromhex(got["read"]) == b"good"           # it does read
        # A reader asking for the writable fd is denied.
        denied = _as_nobody(r.node.shm_endpoint, r.extent.segment_id, r.extent.offset, True)
        assert denied["fds"] == 0 and denied["status"] == 7, denied
        assert kv.get("owned", verify=True) == b"good" * 1024


def test_shm_reads_map_read_only(cluster):
    """This process is trusted to write; its reads still go through a PROT_READ mapping of a
    read-only fd, so a stray write through it faults instead of changing an object."""
    from kvpool.client.transport.base import IoOp
    from kvpool.client.transport.shm import SHMTransport

    with KVClient(cluster.master, replicas=1, transports=["shm"]) as kv:
        kv.put("owned", b"good" * 1024)
    r = _shm_replica(cluster.master, "owned")
    shm = SHMTransport(timeout_s=5)
    try:
        buf = bytearray(4096)
        assert shm.read([IoOp(r, memoryview(buf))]) == [None]
        assert bytes(buf) == b"good" * 1024
        [(key, mapping)] = shm._links[r.node.shm_endpoint].mappings.items()
        assert key == (r.extent.segment_id, False)
        assert mapping.view.readonly
        with pytest.raises(TypeError):
            mapping.mmap[r.extent.offset:r.extent.offset + 4] = b"EVIL"
    finally:
        shm.close()


# ---------------------------------------------------------------- grants on the tcp data port

def _send(replica, frame: bytes, payload: bytes = b"") -> tuple[int, bytes]:
    """One request on a fresh connection to ``replica``'s node: (status, reply payload)."""
    from kvpool.net.data_port import RESPONSE
    from kvpool.net.sockets import recv_exact

    host, _, port = replica.node.tcp_endpoint.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(frame + payload)
        if payload:
            s.shutdown(socket.SHUT_WR)
        status, n = RESPONSE.unpack(recv_exact(s, RESPONSE.size))
        return status, recv_exact(s, n) if n else b""


def _write(replica, data: bytes, grant: bytes = b"") -> int:
    from kvpool.net.data_port import Op, encode_request

    e = replica.extent
    return _send(replica, encode_request(Op.WRITE, e.segment_id, e.offset, len(data),
                                         *((grant,) if grant else ())), data)[0]


def _located(master: str, key: str):
    with MasterClient(master) as mc:
        [view] = mc.locate([key]).views()
    return view


def test_a_committed_object_cannot_be_overwritten_through_the_data_port(cluster):
    """The attack: WRITE at the extent GetReplicas returns. Without a grant, with the read
    grant GetReplicas gave, and with the writer's own (spent) write grant: each DENIED; the
    owner's get(verify=True) returns the owner's bytes."""
    from kvpool.client.transport.base import IoOp
    from kvpool.client.transport.tcp import TCPTransport
    from kvpool.net.data_port import FrameStatus

    value = b"good" * 1024
    with KVClient(cluster.master, replicas=2) as kv:
        kv.put("owned", value)
        view = _located(cluster.master, "owned")
        for r in view.replicas:
            status = _write(r, b"EVIL" * 1024)                             # no grant
            assert status != FrameStatus.OK, "the attacker overwrote a committed object"
            assert status == FrameStatus.DENIED
            assert _write(r, b"EVIL" * 1024, r.grant) == FrameStatus.DENIED   # a read grant
        assert kv.get("owned", verify=True) == value
        # A writer's grant writes its extent once, until the put commits; never after.
        with MasterClient(cluster.master) as mc:
            [placed], _timeout = mc.put_start(["mine"], [4096], replicas=1)
            [replica] = placed
            tcp = TCPTransport(timeout_s=5)
            assert tcp.write([IoOp(replica, memoryview(b"mine" * 1024))]) == [None]
            assert mc.put_end(["mine"]) == [None]
            again = tcp.write([IoOp(replica, memoryview(b"EVIL" * 1024))])
            tcp.close()
        assert again[0] is not None and "spent" in str(again[0])
        assert kv.get("mine", verify=True) == b"mine" * 1024


def test_a_whole_segment_cannot_be_read_through_the_data_port(cluster):
    from kvpool.net.data_port import FrameStatus, Op, encode_request

    with KVClient(cluster.master, replicas=1) as kv:
        kv.put("small", b"s" * 4096)
    [r] = _located(cluster.master, "small").replicas
    sid = r.extent.segment_id
    status, message = _send(r, encode_request(Op.READ, sid, 0, 64 * MiB))
    assert status != FrameStatus.OK, "the attacker read the whole segment"
    assert status == FrameStatus.DENIED, (status, message[:80])
    # A grant for 4 KiB does not stretch to the segment, nor to a neighbour.
    for offset, length in ((0, 64 * MiB), (r.extent.offset, 8192),
                           (r.extent.offset + 4096, 4096)):
        status, _ = _send(r, encode_request(Op.READ, sid, offset, length, r.grant))
        assert status == FrameStatus.DENIED, (offset, length)
    status, data = _send(r, encode_request(Op.READ, sid, r.extent.offset, 4096, r.grant))
    assert status == FrameStatus.OK and data == b"s" * 4096


def test_an_rdma_region_needs_the_grant_of_its_extent(cluster):
    """RKEY_READ/RKEY_WRITE (a region over one extent, net/data_port.py) are checked as READ
    and WRITE are: no grant, or a grant of another extent or operation, is DENIED before the
    node looks for a device; a node without RDMA answers a granted one UNSUPPORTED (the rdma
    tests get regions for real, in the soft-RoCE VM)."""
    from kvpool.net.data_port import FrameStatus, Op, encode_request

    with KVClient(cluster.master, replicas=1) as kv:
        kv.put("region", b"r" * 4096)
    [r] = _located(cluster.master, "region").replicas
    sid, offset = r.extent.segment_id, r.extent.offset
    for op in (Op.RKEY_READ, Op.RKEY_WRITE):
        assert _send(r, encode_request(op, sid, 0, 64 * MiB))[0] == FrameStatus.DENIED
        assert _send(r, encode_request(op, sid, offset, 8192, r.grant))[0] == FrameStatus.DENIED
    # A read grant grants no write region; its own extent's read region, where RDMA runs.
    assert _send(r, encode_request(Op.RKEY_WRITE, sid, offset, 4096, r.grant))[0] \
        == FrameStatus.DENIED
    status, message = _send(r, encode_request(Op.RKEY_READ, sid, offset, 4096, r.grant))
    assert status == FrameStatus.UNSUPPORTED and b"no RDMA device" in message, message


def test_a_reserve_over_another_objects_extent_needs_a_grant(cluster):
    """A RESERVE without a grant for the extent would drop the victim's record from the
    node's manifest (it takes the place as stale): after a master restart the object would
    be gone. DENIED, and the victim survives a restart."""
    from kvpool.net.data_port import FrameStatus, Op, PutRecord, encode_record_request

    with KVClient(cluster.master, replicas=1) as kv:
        kv.put("victim", b"v" * 4096)
        with MasterClient(cluster.master) as mc:   # the attacker learns the epoch honestly
            _placed, _t, grant = mc.put_start_grant(["attacker"], [16], replicas=1)
            mc.put_revoke(["attacker"])
        [r] = _located(cluster.master, "victim").replicas
        e = r.extent
        record = PutRecord("attacker-key", 1, grant.epoch, 60.0)
        for which in ("none", "the victim's read grant"):
            g = b"" if which == "none" else r.grant
            frame = encode_record_request(Op.RESERVE, e.segment_id, e.offset, e.length, record,
                                          *((g,) if g else ()))
            status, _ = _send(r, frame)
            assert status != FrameStatus.OK, "the attacker reserved the victim's extent"
            assert status == FrameStatus.DENIED
        cluster.restart_master()
        deadline = time.monotonic() + 20
        while True:
            try:
                assert kv.get("victim", verify=True) == b"v" * 4096
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.3)
