"""``kvpool bench`` end to end on a tiny workload: the JSON it writes (not the speed), and that
everything it starts -- a local cluster, the raw tcp peer, redis-server, Mooncake -- is gone
afterwards, whether it finished, failed, or was interrupted."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
from kvpool.tools.bench_mooncake import why_unavailable as why_no_mooncake
from kvpool.tools.bench_peers import RawTCPPeer, RedisPeer
from kvpool.tools.bench_report import PLAIN, RATIO_DEFINITIONS, validate_report

# A tiny version of every workload: seconds, not minutes.
TINY = ["--quick", "--sizes", "4KiB", "--single-calls", "2", "--prompt-blocks", "4",
        "--block-size", "64KiB", "--small-blocks", "8", "--small-size", "4KiB",
        "--master-objects", "2000", "--master-batch", "500"]
MARK = "KVPOOL_BENCH_TEST_MARK"
NO_MOONCAKE = why_no_mooncake()   # as the bench decides: by importing it
needs_mooncake = pytest.mark.skipif(bool(NO_MOONCAKE), reason=NO_MOONCAKE)
needs_redis = pytest.mark.skipif(shutil.which("redis-server") is None,
                                 reason="redis-server is not installed (apt-get install "
                                        "redis-server; bash scripts/setup.sh --tests installs it)")


def processes_marked(mark: str) -> list[int]:
    """Live processes whose environment carries ``MARK=mark`` (children inherit it)."""
    found = []
    needle = f"{MARK}={mark}".encode()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes()
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if needle in env.split(b"\0") and state != "Z":
            found.append(int(pid))
    return found


def wait_until_none(mark: str, timeout_s: float = 15.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while (left := processes_marked(mark)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def bench(*args: str, mark: str, **kw) -> subprocess.Popen:
    env = dict(os.environ, **{MARK: mark})
    return subprocess.Popen([sys.executable, "-m", "kvpool", "bench", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


@pytest.mark.slow
def test_quick_smoke_run_writes_a_valid_report(tmp_path):
    mark = uuid.uuid4().hex
    out = tmp_path / "bench.json"
    proc = bench(*TINY, "--json", str(out), "--peers", "mooncake", mark=mark)
    stdout, stderr = proc.communicate(timeout=170)
    assert proc.returncode == 0, stderr[-3000:]
    assert "Traceback" not in stderr
    report = json.loads(out.read_text())
    assert validate_report(report) == []
    ratios = report["ratios"]
    for name, _, _ in RATIO_DEFINITIONS:
        peer = "redis" if "redis" in name else "mooncake-local" if "mooncake_local" in name \
            else "mooncake" if "mooncake" in name else None
        if peer in report["skipped"]:
            assert ratios[name] is None
        else:
            assert isinstance(ratios[name], float) and ratios[name] > 0, name
    master = ratios["master"]
    assert master["put_objects_per_s"] > 0 and master["lookup_objects_per_s"] > 0
    assert master["bytes_per_object"] is not None
    # Two client processes at once (--master-clients' default), each with its connection.
    busy = report["master"]
    assert busy["clients"] == 2 and busy["put_objects_per_s_concurrent"] > 0 \
        and busy["lookup_objects_per_s_concurrent"] > 0
    assert "master kept busy by 2 clients at once" in stdout
    if NO_MOONCAKE:
        assert report["skipped"]["mooncake"] == NO_MOONCAKE
    else:
        for transport in ("tcp", "local"):   # its tcp transport and its same-host path
            assert {r["workload"] for r in report["results"]
                    if r["system"] == "mooncake" and r["transport"] == transport} \
                == {"single", "prompt", "small"}, transport
        # Its calls were made in turns with kvpool's, once per transport; no twice.
        assert stderr.count("Mooncake Store (mooncake") == 2
        assert stderr.count("its calls in turns with kvpool's") == 2
        assert "zero-copy batch calls" not in stderr   # none timed apart
        assert stderr.count("its single calls in turns with kvpool's") \
            == ("redis" not in report["skipped"])   # Redis's, beside shm
        assert len([r for r in report["results"] if r["system"] == "mooncake"
                    and r["workload"] == "single"]) == 2 * 2   # put and get, per transport
    if "redis" not in report["skipped"]:   # its single calls once, in turns beside shm
        assert len([r for r in report["results"] if r["system"] == "redis"
                    and r["workload"] == "single"]) == 2
    assert {"shm_get_vs_memcpy", "master.bytes_per_object"} <= {t["name"] for t in
                                                                 report["targets"]}
    assert "target" in stdout and "shm_get_vs_memcpy" in stdout
    assert sorted(p.name for p in tmp_path.glob("*.png")) == ["bench_batches.png",
                                                              "bench_single.png"]
    assert wait_until_none(mark) == []


@pytest.mark.slow
def test_security_on_beside_off_in_one_run(tmp_path):
    """--compare-insecure: kvpool's figures on a secure and a plain cluster, each ratio both
    ways and secure/plain against its bound; each system timed on two clusters, started in
    both orders (their repeats pooled); every cluster stopped at the end."""
    mark = uuid.uuid4().hex
    out = tmp_path / "bench.json"
    proc = bench(*TINY, "--json", str(out), "--compare-insecure", "--no-master-bench",
                 "--no-redis", "--transports", "shm,tcp", mark=mark)
    stdout, stderr = proc.communicate(timeout=170)
    assert proc.returncode == 0, stderr[-3000:]
    report = json.loads(out.read_text())
    assert validate_report(report) == []
    kinds = {(r["system"], r["transport"], r["workload"], r["op"]) for r in report["results"]}
    for transport in ("shm", "tcp"):
        for workload in ("single", "prompt", "small"):
            for op in ("put", "get"):
                assert {("kvpool", transport, workload, op),
                        (PLAIN, transport, workload, op)} <= kinds
    assert {r["repeats"] for r in report["results"] if r["system"] in ("kvpool", PLAIN)} \
        == {2 * report["config"]["repeats"]}
    assert stderr.count("without credentials") == 2
    targets = {t["name"]: t for t in report["targets"]}
    for name in ("shm_get_vs_memcpy", "tcp_put_vs_raw_tcp"):
        ratios = report["ratios"]
        assert ratios[f"{name}_secure_vs_plain"] == pytest.approx(
            ratios[name] / ratios[f"{name}_plain"], rel=1e-3)
        assert targets[f"{name}_secure_vs_plain"]["target"] == 0.9
    assert "shm_get_vs_memcpy_secure_vs_plain" in stdout
    assert wait_until_none(mark) == []


def test_a_spawned_client_makes_its_calls_in_its_own_process_and_reports_what_failed():
    """--compare-insecure's clients (SpawnedClient): each call runs in the child, kvpool's
    error there is raised here as a KVPoolError (the bench skips a transport on one), and a
    child that dies is said to have died, not waited for."""
    from kvpool.common.errors import KVPoolError
    from kvpool.tools.bench_kvpool import BenchError, connect
    with socket.socket() as s:   # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        nobody = f"127.0.0.1:{s.getsockname()[1]}"
    client = connect(nobody, "tcp", spawned=True)
    try:
        assert client._proc.pid != os.getpid()
        assert client.reachable("probe") is False
        client.load(np.zeros((1, 64), np.uint8))
        with pytest.raises(KVPoolError, match="PutStart failed"):   # kvpool's own error
            client.calls("put", [["k"]], [True], False)
        os.kill(client._proc.pid, signal.SIGKILL)
        with pytest.raises(BenchError, match="died"):
            client.calls("put", [["k"]], [True], False)
    finally:
        client.close()
    assert not client._proc.is_alive()


def test_compare_insecure_refuses_another_cluster_and_insecure():
    for extra in (["--master", "127.0.0.1:1"], ["--insecure"]):
        proc = bench(*TINY, "--compare-insecure", *extra, mark=uuid.uuid4().hex)
        _, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 2 and "--compare-insecure" in stderr, stderr


def test_data_tls_benches_a_node_whose_tcp_port_speaks_tls(tmp_path):
    """--data-tls: the local cluster's node serves tcp over TLS (store-node --data-tls) and
    the figures are its; refused with --insecure or --master (nothing to start secure)."""
    out = tmp_path / "bench.json"
    proc = bench(*TINY, "--json", str(out), "--data-tls", "--no-master-bench", "--no-redis",
                 "--transports", "tcp", mark=uuid.uuid4().hex)
    _, stderr = proc.communicate(timeout=170)
    assert proc.returncode == 0, stderr[-3000:]
    assert "its tcp data port over TLS" in stderr
    report = json.loads(out.read_text())
    assert report["config"]["data_tls"] is True
    assert {("kvpool", "tcp", "prompt", "get"), ("kvpool", "tcp", "single", "put")} <= {
        (r["system"], r["transport"], r["workload"], r["op"]) for r in report["results"]}
    for extra in (["--master", "127.0.0.1:1"], ["--insecure"]):
        proc = bench(*TINY, "--data-tls", *extra, mark=uuid.uuid4().hex)
        _, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 2 and "--data-tls" in stderr, stderr


@pytest.mark.slow
def test_interrupted_run_stops_everything_it_started(tmp_path):
    mark = uuid.uuid4().hex
    proc = bench(*TINY, "--single-calls", "50", mark=mark)
    try:
        # Interrupt once the local cluster is serving kvpool workloads.
        for line in proc.stderr:
            if "kvpool shm:" in line:
                break
        else:
            pytest.fail(f"the bench ended before its kvpool stage (rc {proc.wait()})")
        assert processes_marked(mark), "the cluster should be running now"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()
    assert wait_until_none(mark) == []


def test_unreachable_master_fails_cleanly_and_stops_the_baselines():
    mark = uuid.uuid4().hex
    proc = bench(*TINY, "--master", "127.0.0.1:1", "--no-redis", mark=mark)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 1
    assert "kvpool bench: error:" in stderr and "Traceback" not in stderr
    assert wait_until_none(mark) == []


@needs_redis
def test_redis_peer_stops_its_server():
    with RedisPeer() as redis:
        pid, port = redis.proc.pid, redis.port
        redis.put(["a"], [memoryview(b"value")])
        assert redis.get(["a"]) == [b"value"]
    assert redis.proc.poll() is not None, "redis-server still running"
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    assert not Path(f"/proc/{pid}").exists() or \
        Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"


@needs_mooncake
def test_mooncake_peer_moves_bytes_between_processes_and_stops():
    from kvpool.tools.bench_mooncake import MooncakePeer
    src = np.arange(4 * 4096, dtype=np.uint32).view(np.uint8).reshape(16, 4096)
    dst = np.zeros_like(src)
    with MooncakePeer(64 << 20) as peer:
        procs = [peer._master, peer._holder]
        peer.register(src)
        peer.register(dst)
        keys = [f"k{i}" for i in range(16)]
        assert peer.put(keys, src) == [0] * 16
        assert peer.get(keys, dst) == [4096] * 16
        peer.delete(keys)
        assert all(n < 0 for n in peer.get(keys, dst))   # gone: an error code per key
    assert np.array_equal(src, dst)
    assert all(p.poll() is not None for p in procs), "a Mooncake process is still running"


@needs_mooncake
def test_mooncake_local_peer_keeps_values_in_this_process_and_stops():
    # The same-host path: no holder; this client's own segment is the only one, so every
    # value lives here and Mooncake copies it with memcpy (tools/bench_mooncake.py).
    from kvpool.tools.bench_mooncake import MooncakePeer
    src = np.arange(4 * 4096, dtype=np.uint32).view(np.uint8).reshape(16, 4096)
    dst = np.zeros_like(src)
    memcpy = os.environ.get("MC_STORE_MEMCPY")
    with MooncakePeer(64 << 20, local=True) as peer:
        assert peer._holder is None and peer.transport == "local"
        procs = [peer._master]
        peer.register(src)
        peer.register(dst)
        keys = [f"k{i}" for i in range(16)]
        assert peer.put(keys, src) == [0] * 16
        assert peer.get(keys, dst) == [4096] * 16
        peer.delete(keys)
        assert all(n < 0 for n in peer.get(keys, dst))
    assert np.array_equal(src, dst)
    assert os.environ.get("MC_STORE_MEMCPY") == memcpy   # set for its setup only
    assert all(p.poll() is not None for p in procs), "a Mooncake process is still running"


def test_raw_tcp_peer_moves_bytes_and_stops():
    rows = [memoryview(bytes([i]) * 4096) for i in range(4)]
    out = [memoryview(bytearray(4096)) for _ in range(4)]
    with RawTCPPeer() as peer:
        peer.put(rows)
        peer.get(out)
        proc = peer.proc
    assert proc.poll() is not None
    assert all(len(o) == 4096 for o in out)


@pytest.mark.parametrize("slots", [True, False])
def test_put_phases_names_where_a_puts_time_goes(slots):
    """scripts/put_phases.py (the per-phase breakdown the issue-19 notes quote) runs, and each
    phase of a put (of a get) it reports took time and less than the whole call; with slots, a
    put is the copy and PutEnd (sealed on the node's seal board: no SEAL frame), the slots made
    apart, ahead."""
    script = Path(__file__).resolve().parents[2] / "scripts" / "put_phases.py"
    out = subprocess.run([sys.executable, str(script), "--calls", "30", "--insecure",
                          *(() if slots else ("--no-slots", "--no-local-reads"))],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    put, get = map(float, re.search(r"put (\d+\.\d+)\s+get (\d+\.\d+)", out).groups())
    found = re.findall(r"^    (\S.*?)\s+(\d+\.\d+)(?:\s+\((\d+) calls\))?$", out, re.M)
    phases = {k: v for k, v, _ in found}
    calls = {k: int(n) for k, _, n in found if n}
    master_path = ("GetReplicas (master round trip)", "READ (node round trip)")
    if slots:   # and local reads: a get is a read from the node's shm index, the master's
        # only the first (the client learns its tenant) and any the index could not prove
        local = "read from the node's shm index (no master call)"
        assert 0 < float(phases.pop(local)) <= get, out
        assert calls[local] >= 30 - 30 // 3 >= calls.get(master_path[0], 0), out
        for k in master_path:
            phases.pop(k, None)
    else:
        in_gets = {k: float(phases.pop(k)) for k in master_path}
        assert all(0 < v <= get for v in in_gets.values()), out
    # With slots a put is the copy and PutEnd: the master's PutStart calls and the RESERVEs
    # are the helper's (a slot batch each), and a put that found no slot is not typical.
    in_puts = {k: float(v) for k, v in phases.items() if "slot helper" not in k} if not slots \
        else {k: float(phases[k]) for k in ("copy + CRC-32C", "PutEnd (master round trip)")}
    assert {"copy + CRC-32C", "PutEnd (master round trip)", "GetReplicas"} <= set(phases), out
    seal = "SEAL (node round trip, PutEnd overlapped)"
    if slots:   # (a few may find no slot ready on a loaded machine, and go the usual way)
        assert calls.get("PutStart (master round trip)", 0) <= 30 // 3, out
        assert calls.get(seal, 0) <= 30 // 3, out
        assert "RESERVE (node round trip) [slot helper, ahead of puts]" in phases, out
    else:
        assert {"PutStart (master round trip)", "RESERVE (node round trip)", seal} \
            <= set(in_puts), out
    assert all(0 < v <= put for v in in_puts.values()), out


def test_put_phases_times_tcp_gets_at_the_held_place():
    """Over tcp, a get of a key the client put is a READ_HELD at the place its PutStart named
    (no master call): most of the 30 gets (a few, within ~50 ms of their put's commit, ask the
    master), each shorter than the whole get."""
    script = Path(__file__).resolve().parents[2] / "scripts" / "put_phases.py"
    out = subprocess.run([sys.executable, str(script), "--transport", "tcp", "--calls", "30",
                          "--insecure"], capture_output=True, text=True, timeout=120,
                         check=True).stdout
    get = float(re.search(r"put \d+\.\d+\s+get (\d+\.\d+)", out).group(1))
    held = re.search(r"^    READ_HELD where the put was .*?\s+(\d+\.\d+)\s+\((\d+) calls\)$",
                     out, re.M)
    assert held is not None, out
    assert 0 < float(held.group(1)) <= get and int(held.group(2)) >= 20, out


def test_put_phases_splits_a_batch_too():
    """scripts/put_phases.py --batch: a batch put (not sealed: more than 4 keys) is PutStart,
    the copy and PutEnd, each shorter than the whole call, and a batch get is GetReplicas and
    the read in place."""
    script = Path(__file__).resolve().parents[2] / "scripts" / "put_phases.py"
    out = subprocess.run([sys.executable, str(script), "--calls", "10", "--batch", "16",
                          "--insecure"], capture_output=True, text=True, timeout=120,
                         check=True).stdout
    put, get = map(float, re.search(r"put (\d+\.\d+)\s+get (\d+\.\d+)", out).groups())
    phases = {k: float(v) for k, v in re.findall(r"^    (\S.*?)\s+(\d+\.\d+)", out, re.M)}
    in_puts = {"PutStart (master round trip)", "copy + CRC-32C", "PutEnd (master round trip)"}
    in_gets = {"GetReplicas (master round trip)", "READ (node round trip)"}
    assert in_puts | in_gets <= set(phases) and not any("SEAL" in k for k in phases), out
    assert all(0 < phases[k] <= put for k in in_puts), out
    assert all(0 < phases[k] <= get for k in in_gets), out


def test_lookup_phases_names_where_a_lookups_time_goes():
    """scripts/lookup_phases.py (the split DESIGN.md "Where a lookup's time goes" quotes) runs
    the master's handler at steady state: leases end while others begin, and each phase it
    reports took time and less than the whole call."""
    script = Path(__file__).resolve().parents[2] / "scripts" / "lookup_phases.py"
    out = subprocess.run([sys.executable, str(script), "--objects", "20000", "--calls", "100",
                          "--interval-us", "1000000"],   # a lease spans 5 calls
                         capture_output=True, text=True, timeout=120, check=True).stdout
    phases = {k: float(v) for k, v in re.findall(r"^  (\S.*?)\s+(\d+\.\d+)$", out, re.M)}
    whole = phases.pop("the whole handler (MasterServicer.get_replicas)")
    assert {"leases ending (Leases.expire)", "read grants (GrantMinter.mint)",
            "index walk (dict.get per key, timed apart)"} <= set(phases), out
    assert "eviction order touches" not in out   # reads are told when a walk comes to them
    assert all(0 < v < whole for v in phases.values()), out
    running = int(re.search(r"([\d,]+) leases running", out).group(1).replace(",", ""))
    assert 0 < running <= 8 * 256, out   # the last few calls' leases: the others ended
