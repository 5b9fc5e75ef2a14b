"""/metrics, /healthz and /readyz (common/metrics.py) of a real master and store node, each a
process of its own started with ``--metrics-port 0``; figures checked against what a client did."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
from kvpool.client.kv_client import KVClient
from kvpool.common.config import MasterConfig
from kvpool.common.errors import InvalidArgument, ObjectNotFound
from kvpool.master.server import MasterServer
from kvpool.rpc.master_client import MasterClient
from kvpool.tools.cluster import LocalCluster, Proc
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from .conftest import FAST_MASTER, FAST_NODE

SEGMENT = 8 << 20


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _samples(base: str) -> dict[tuple[str, frozenset], float]:
    status, text = _get(base + "/metrics")
    assert status == 200
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _eventually_ready(base: str) -> None:
    deadline = time.monotonic() + 10
    while (answer := _get(base + "/readyz")) != (200, "ready\n"):
        assert time.monotonic() < deadline, answer
        time.sleep(0.1)


@pytest.fixture
def procs(tmp_path):
    """Starts ``python -m kvpool ARGV`` as NAME (log: tmp_path/NAME.log); stops them all."""
    started: list[Proc] = []
    with contextlib.ExitStack() as logs:
        def start(name: str, argv: list[str]) -> Proc:
            log = logs.enter_context(open(tmp_path / f"{name}.log", "wb"))
            started.append(Proc(name, argv, log))
            return started[-1]
        yield start
        for p in reversed(started):
            p.terminate()
    for p in started:
        assert "Traceback" not in (tmp_path / f"{p.name}.log").read_text(), p.name


def test_master_and_node_serve_their_figures_and_probes(tmp_path):
    c = LocalCluster(nodes=1, segment_size=str(SEGMENT), master_args=FAST_MASTER,
                     node_args=FAST_NODE, log_dir=tmp_path / "logs", metrics=True)
    with c:
        address = c.master
        mm, nm = (f"http://{c.metrics_addresses[name]}" for name in ("master", "node0"))
        _check_figures(address, mm, nm)
    for log in (tmp_path / "logs").glob("*.log"):
        assert "Traceback" not in log.read_text(), log.name


def _check_figures(address: str, mm: str, nm: str) -> None:
    assert _get(mm + "/healthz") == (200, "ok\n")
    assert _get(mm + "/readyz") == (200, "ready\n")
    assert _get(mm + "/nothing")[0] == 404
    _eventually_ready(nm)

    # No slots (client/slots.py): their helper's PutStart would count as calls of this test.
    with KVClient(address, put_slots=False) as kv:
        kv.put("a", b"x" * 1000)                  # over shm: one segment hand-off
        assert kv.get("a") == b"x" * 1000
        with pytest.raises(ObjectNotFound):
            kv.get("absent")
    with KVClient(address, transports=["tcp"], put_slots=False) as kv:
        kv.put("ns1/sub/b", b"y" * 3000)          # over tcp: WRITE then READ, 3000 bytes each
        assert kv.get("ns1/sub/b") == b"y" * 3000
        n = _samples(nm)
        assert n["kvpool_node_connections", frozenset({("node", "node0"),
                                                        ("transport", "tcp")})] >= 1
    with MasterClient(address) as mc, pytest.raises(InvalidArgument):
        mc.put_start(["c", "d"], [10])   # the master aborts the call: INVALID_ARGUMENT

    m = _samples(mm)
    assert m["kvpool_master_objects", frozenset({("state", "complete")})] == 2
    assert m["kvpool_master_objects", frozenset({("state", "pending")})] == 0
    assert m["kvpool_master_nodes", frozenset()] == 1
    assert m["kvpool_master_leader", frozenset()] == 1
    assert m["kvpool_master_recovering_segments", frozenset()] == 0
    assert m["kvpool_master_lookups_total", frozenset({("result", "hit")})] >= 1
    assert m["kvpool_master_lookups_total", frozenset({("result", "miss")})] >= 1
    assert m["kvpool_master_evictions_total", frozenset()] == 0
    # The master's collector: every generation's pauses timed, the startup's objects frozen.
    for generation in "012":
        assert ("kvpool_master_gc_pause_seconds_count",
                frozenset({("generation", generation)})) in m
    assert m["kvpool_master_gc_frozen_objects", frozenset()] > 10_000
    assert m["kvpool_master_corrupt_replicas_total", frozenset()] == 0
    [(labels, capacity)] = [(dict(k[1]), v) for k, v in m.items()
                            if k[0] == "kvpool_segment_capacity_bytes"]
    assert (labels["node"], labels["tier"], capacity) == ("node0", "dram", SEGMENT)
    seg = frozenset(labels.items())
    assert m["kvpool_segment_objects", seg] == 2
    assert m["kvpool_segment_used_bytes", seg] >= 4000   # aligned sizes of both objects
    assert m["process_resident_memory_bytes", frozenset()] > 0
    # Each call timed and counted, over gRPC or the lookup port: two puts (a PutStart and a
    # PutEnd each, OK), and the refused PutStart.
    for method, calls in (("PutStart", 3), ("PutEnd", 2)):
        assert m["kvpool_master_rpcs_total", frozenset({("method", method), ("code", "OK")})] \
            == 2
        assert m["kvpool_master_rpc_seconds_count", frozenset({("method", method)})] == calls
        assert m["kvpool_master_rpc_seconds_sum", frozenset({("method", method)})] > 0
    mounts = m["kvpool_master_rpcs_total", frozenset({("method", "MountSegment"),
                                                      ("code", "OK")})]
    assert mounts >= 1
    assert m["kvpool_master_rpcs_total", frozenset({("method", "PutStart"),
                                                   ("code", "INVALID_ARGUMENT")})] == 1

    n = _samples(nm)
    assert n["kvpool_node_segment_capacity_bytes", seg] == SEGMENT
    assert n["kvpool_node_manifest_objects", frozenset({("node", "node0")})] == 2
    assert n["kvpool_node_ready", frozenset({("node", "node0")})] == 1
    assert n["kvpool_node_moves_queued", frozenset({("node", "node0")})] == 0
    # (the commits reach the node's shm index within PUSH_SOON_S of the puts)
    assert 0 <= n["kvpool_node_shm_index_objects", frozenset({("node", "node0")})] <= 2
    assert n["kvpool_node_shm_index_left_out_total", frozenset({("node", "node0")})] == 0
    def node(**labels: str) -> frozenset:
        return frozenset({("node", "node0"), *labels.items()})
    assert n["kvpool_node_requests_total", node(transport="shm", op="HANDOFF")] >= 1
    for op in ("WRITE", "READ"):
        assert n["kvpool_node_requests_total", node(transport="tcp", op=op)] == 1
        assert n["kvpool_node_bytes_total", node(transport="tcp", op=op)] == 3000
    assert n["kvpool_node_segment_used_bytes",
             node(segment=labels["segment"], tier="dram")] == 4000   # sizes, not aligned
    for name in ("scrub_checked_objects", "scrub_checked_bytes", "scrub_mismatches"):
        assert n[f"kvpool_node_{name}_total", node()] >= 0
    # Hits and misses per namespace: "a" and "absent" have none, "ns1/sub/b" has "ns1/sub".
    assert m["kvpool_master_namespace_lookups_total",
             frozenset({("namespace", ""), ("result", "hit")})] == 1
    assert m["kvpool_master_namespace_lookups_total",
             frozenset({("namespace", ""), ("result", "miss")})] == 1
    assert m["kvpool_master_namespace_lookups_total",
             frozenset({("namespace", "ns1/sub"), ("result", "hit")})] == 1
    # The gets' lookups went to the lookup port (the client finds it in gRPC answers).
    assert m["kvpool_master_lookup_port_calls_total", frozenset({("method", "GetReplicas")})] \
        >= 1
    assert m["kvpool_master_manifest_unacked", frozenset({("node", "node0")})] == 0
    assert m["kvpool_master_manifest_wait_timeouts_total", frozenset()] == 0
    assert m["kvpool_master_silent_nodes", frozenset()] == 0
    assert m["kvpool_master_nodes_expired_total", frozenset()] == 0
    assert m["kvpool_master_pinned_bytes", frozenset()] == 0
    # The two gets' leases, unless LEASE_TTL_S (1 s) ran out since (LeaseCount's own test
    # checks the counting); the miss took none.
    assert m["kvpool_master_leases", frozenset()] in (0, 1, 2)


def test_a_node_that_cannot_mount_is_alive_but_not_ready(procs):
    # A port that refuses connections: the node keeps retrying its mount meanwhile.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        nowhere = f"127.0.0.1:{s.getsockname()[1]}"
        node = procs("node0", ["store-node", "--master", nowhere, "--segment-size",
                               str(SEGMENT), "--metrics-port", "0", *FAST_NODE])
        nm = "http://" + node.wait_ready("metrics")
        assert _get(nm + "/healthz") == (200, "ok\n")
        assert _get(nm + "/readyz") == (
            503, "not ready: starting: not mounted on the master yet\n")
        [ready] = [v for (name, _), v in _samples(nm).items() if name == "kvpool_node_ready"]
        assert ready == 0


def test_json_logs_are_one_object_per_line_with_the_events_fields(procs, tmp_path):
    master = procs("master", ["master", "--port", "0", "--log-format", "json"])
    address = master.wait_ready("master")
    master.terminate()
    lines = (tmp_path / "master.log").read_text().splitlines()
    events = [json.loads(line) for line in lines if line.startswith("{")]
    assert len(events) == len(lines), lines   # every line a JSON object
    [started] = [e for e in events if e["event"] == "master_started"]
    assert started["address"] == address and started["level"] == "info"
    assert started["component"] == "master" and "timestamp" in started


@pytest.mark.parametrize("argv", [["master", "--port", "0"],
                                  ["store-node", "--master", "127.0.0.1:1", "--segment-size",
                                   str(SEGMENT)]], ids=["master", "store-node"])
def test_a_taken_metrics_port_fails_the_start_with_a_clear_error(argv):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "kvpool", *argv, "--metrics-port", str(port)],
                           capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"cannot listen on 127.0.0.1:{port} for metrics" in r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""


async def test_a_master_whose_metrics_port_is_taken_serves_nothing():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        server = MasterServer(MasterConfig(), metrics_port=taken.getsockname()[1])
        with pytest.raises(OSError, match="for metrics"):
            await server.start()
    assert server.port == 0   # its gRPC port was never bound


def test_a_client_counts_its_keys_bytes_and_call_times_in_the_callers_registry(tmp_path):
    registry = CollectorRegistry()

    def value(name: str, **labels: str) -> float:
        return registry.get_sample_value(name, labels) or 0.0

    with LocalCluster(nodes=1, segment_size=str(SEGMENT), master_args=FAST_MASTER,
                      node_args=FAST_NODE, log_dir=tmp_path / "logs") as c:
        with KVClient(c.master, metrics=registry) as kv:        # shm, this host's node
            kv.batch_put(["a", "b"], [b"x" * 1000, b"y" * 500])
            assert kv.batch_put(["a"], [b"z"])[0] is not None   # AlreadyExists
            assert kv.get("a") == b"x" * 1000
            with pytest.raises(ObjectNotFound):
                kv.get("absent")
        # A second client of the same registry adds to the same series.
        with KVClient(c.master, transports=["tcp"], metrics=registry) as kv:
            assert kv.batch_get(["a", "b"]) == [b"x" * 1000, b"y" * 500]
    assert value("kvpool_client_keys_total", op="put", result="stored") == 2
    assert value("kvpool_client_keys_total", op="put", result="exists") == 1
    assert value("kvpool_client_keys_total", op="get", result="hit") == 3
    assert value("kvpool_client_keys_total", op="get", result="miss") == 1
    assert value("kvpool_client_bytes_total", op="put", transport="shm") == 1500
    assert value("kvpool_client_bytes_total", op="get", transport="shm") == 1000
    assert value("kvpool_client_bytes_total", op="get", transport="tcp") == 1500
    assert value("kvpool_client_op_seconds_count", op="put") == 2
    assert value("kvpool_client_op_seconds_count", op="get") == 3
    assert value("kvpool_client_op_seconds_sum", op="get") > 0
