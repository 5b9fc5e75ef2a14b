"""A real master and store nodes in subprocesses, real sockets and shared memory."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from kvpool.client import KVClient
from kvpool.client.transport.tcp import TCPTransport
from kvpool.common.errors import KVPoolError, NodeUnavailable, ObjectNotFound
from kvpool.rpc.master_client import MasterClient

WORKLOAD = str(Path(__file__).with_name("workload.py"))


def run_workload(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, WORKLOAD, *args], capture_output=True, text=True,
                          timeout=timeout, check=False)


@pytest.mark.parametrize("reader_transports", ["shm,tcp", "tcp"])
def test_thousand_objects_cross_process(cluster, reader_transports):
    put = run_workload("put", cluster.master, "7", "1000", str(128 << 10))
    assert put.returncode == 0, put.stderr
    assert "put ok=1000 bad=0" in put.stdout
    get = run_workload("get", cluster.master, "7", "1000", str(128 << 10), reader_transports)
    assert get.returncode == 0, get.stderr
    assert "get ok=1000 bad=0" in get.stdout
    with MasterClient(cluster.master) as mc:
        s = mc.stats()
    assert s.objects == 1000 and s.hits == 1000 and s.misses == 0
    assert {g.node_id for g in s.segments if g.objects} == {"node0", "node1"}  # spread over both


def _holder(mc: MasterClient, key: str) -> set[str]:
    [view] = mc.locate([key]).views()
    return {r.node.node_id for r in view.replicas}


def test_node_sigkill_mid_workload(cluster, timeouts):
    payload = {f"k{i}": os.urandom(4096 + i) for i in range(200)}
    with KVClient(cluster.master) as kv, MasterClient(cluster.master) as mc:
        assert kv.batch_put(list(payload), list(payload.values())) == [None] * 200
        assert kv.batch_put(["both"], [b"x" * 5000], replicas=2) == [None]
        assert _holder(mc, "both") == {"node0", "node1"}
        on_victim = {k for k in payload if _holder(mc, k) == {"node1"}}
        survivors = set(payload) - on_victim
        assert on_victim and survivors

        wrong, errors, stop = [], [], threading.Event()

        def reader():
            while not stop.is_set():
                for k, v in zip(payload, kv.batch_get(list(payload))):
                    if isinstance(v, KVPoolError):
                        errors.append((k, v))
                    elif v != payload[k]:
                        wrong.append(k)

        t = threading.Thread(target=reader)
        t.start()
        time.sleep(0.3)
        cluster.nodes[1].popen.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        # Within node_ttl the master forgets the dead node: its objects become not-found.
        while time.monotonic() - killed_at < timeouts.node_ttl_s + 3:
            if not any(kv.batch_exists(sorted(on_victim))):
                break
            time.sleep(0.1)
        detected_s = time.monotonic() - killed_at
        time.sleep(0.3)
        stop.set()
        t.join()

        assert not wrong, f"wrong bytes for {wrong[:5]}"
        assert {k for k, _ in errors} <= on_victim          # survivors never failed
        assert all(isinstance(e, (NodeUnavailable, ObjectNotFound)) for _, e in errors)
        assert detected_s < timeouts.node_ttl_s + 2
        for k in sorted(on_victim)[:5]:
            with pytest.raises(ObjectNotFound):
                kv.get(k)
        got = kv.batch_get(sorted(survivors))
        assert got == [payload[k] for k in sorted(survivors)]
        assert kv.get("both") == b"x" * 5000                 # the other replica serves it
        assert mc.stats().nodes == 1


def test_replica_on_dead_node_is_skipped_before_ttl(cluster):
    with KVClient(cluster.master, transports=["tcp"]) as kv:
        kv.put("two", b"y" * 10000, replicas=2)
        cluster.nodes[0].popen.send_signal(signal.SIGKILL)
        cluster.nodes[0].popen.wait()
        for _ in range(5):   # before the master notices: the dead replica fails, the live one serves
            assert kv.get("two") == b"y" * 10000


def test_client_killed_between_put_start_and_put_end(cluster, timeouts):
    size = 8 << 20
    hung = subprocess.Popen([sys.executable, WORKLOAD, "put-start-and-hang", cluster.master,
                             "orphan", str(size)], stdout=subprocess.PIPE, text=True)
    try:
        assert hung.stdout.readline().strip() == "started"
        with MasterClient(cluster.master) as mc:
            s = mc.stats()
            assert s.pending_objects == 1
            assert sum(g.used_bytes for g in s.segments) >= size
        hung.kill()
    finally:
        hung.kill()
        hung.wait()
    with KVClient(cluster.master) as kv, MasterClient(cluster.master) as mc:
        assert not kv.exists("orphan")    # readers never see a PENDING object
        deadline = time.monotonic() + timeouts.put_timeout_s + timeouts.quarantine_s + 3
        while time.monotonic() < deadline:
            s = mc.stats()
            if s.pending_objects == 0 and not any(g.used_bytes or g.quarantined_bytes
                                                  for g in s.segments):
                break
            time.sleep(0.1)
        assert s.pending_objects == 0
        assert sum(g.used_bytes + g.quarantined_bytes for g in s.segments) == 0
        kv.put("orphan", b"z" * size)      # the key and the space are usable again
        assert kv.get("orphan") == b"z" * size


def test_numpy_and_get_into_zero_copy(cluster):
    arr = np.arange(1 << 18, dtype=np.float32)
    with KVClient(cluster.master) as kv:
        kv.put("arr", arr)
        out = np.zeros_like(arr)
        assert kv.get_into("arr", out) == arr.nbytes
        np.testing.assert_array_equal(out, arr)
        buf = bytearray(arr.nbytes + 100)
        assert kv.get_into("arr", buf) == arr.nbytes
        assert bytes(buf[:arr.nbytes]) == arr.tobytes()


class SlowTCP(TCPTransport):
    """A real tcp transport whose reads start only after ``delay_s``: a reader stalled (GC pause,
    busy host) past its lease."""

    def __init__(self, delay_s: float, started: threading.Event):
        super().__init__()
        self.delay_s, self.started = delay_s, started

    def read(self, ops):
        self.started.set()
        time.sleep(self.delay_s)
        return super().read(ops)


def test_reader_past_its_lease_never_returns_another_objects_bytes(cluster, timeouts):
    old, new = b"A" * 100_000, b"B" * 100_000
    started = threading.Event()
    with KVClient(cluster.master, transports=["tcp"]) as kv:
        kv.put("old", old)
        slow = KVClient(cluster.master, transports=[SlowTCP(timeouts.lease_ttl_s * 2.5, started)])
        result: list = []
        t = threading.Thread(target=lambda: result.append(slow.batch_get(["old"])[0]))
        t.start()
        assert started.wait(10)
        kv.remove("old")                      # leased: vanishes now, space freed after the lease
        time.sleep(timeouts.lease_ttl_s + 0.5)
        kv.put("new", new)                    # may reuse the space "old" had
        t.join()
        slow.close()
        assert isinstance(result[0], ObjectNotFound), result[0][:8]
        assert kv.get("new") == new


def test_reader_past_its_lease_still_succeeds_when_nothing_changed(cluster, timeouts):
    started = threading.Event()
    with KVClient(cluster.master, transports=[SlowTCP(timeouts.lease_ttl_s * 1.5, started)]) as kv:
        kv.put("steady", b"s" * 50_000)
        assert kv.get("steady") == b"s" * 50_000   # slow, lease ran out, verified, not failed


def test_cluster_processes_end_with_a_killed_launcher():
    """A launcher killed -9 (a crashed test, a killed shell) leaves no master or node behind.
    Its children are started without a fork-time hook (a vfork: no atfork handler of the
    launcher's gRPC can block it), so they set up ending with it themselves."""
    script = ("import time\nfrom kvpool.tools.cluster import LocalCluster\n"
              "c = LocalCluster(nodes=1, segment_size='8MiB')\nc.start()\n"
              "print(c.master_proc.popen.pid, c.nodes[0].popen.pid, flush=True)\n"
              "time.sleep(120)\n")
    pids = _kill_launcher(script)
    assert len(pids) == 2
    deadline = time.monotonic() + 10.0
    while alive := [p for p in pids if _running(p)]:
        assert time.monotonic() < deadline, f"still running after their launcher: {alive}"
        time.sleep(0.1)


def test_a_child_whose_clean_stop_hangs_still_ends_soon_after_its_launcher():
    """The launcher's death asks a child to stop cleanly (SIGTERM); one whose stop hangs (here:
    it ignores SIGTERM) exits on its own a few seconds later."""
    _orphan_ends("signal.signal(signal.SIGTERM, lambda *_: None)\n")


def test_a_child_the_kernel_does_not_signal_is_still_stopped_cleanly(tmp_path):
    """PDEATHSIG once failed to reach a node of a killed launcher (it ran on, idle): the
    watcher sends the SIGTERM itself, so the child still stops cleanly (its handler runs)."""
    marker = tmp_path / "stopped"
    _orphan_ends("from kvpool.tools.cluster import _prctl, _PR_SET_PDEATHSIG\n"
                 "_prctl(_PR_SET_PDEATHSIG, 0)   # as if it never came\n"
                 f"signal.signal(signal.SIGTERM, lambda *_: (open({str(marker)!r}, 'w').close(), "
                 "sys.exit(0)))\n")
    assert marker.exists(), "ended without its clean stop"


def _orphan_ends(setup: str) -> None:
    """A child of a launcher (Proc's environment: die_with_launcher) runs ``setup`` and waits;
    the launcher is killed -9; the child must end within 8 s."""
    child = ("from kvpool.tools.cluster import die_with_launcher\ndie_with_launcher()\n"
             f"import signal, sys, time\n{setup}print('ready', flush=True)\ntime.sleep(120)\n")
    script = ("import subprocess, sys, time\n"
              f"p = subprocess.Popen([sys.executable, '-c', {child!r}], stdout=subprocess.PIPE, "
              "env={**__import__('os').environ, 'KVPOOL_DIE_WITH_PARENT': '1'}, text=True)\n"
              "assert p.stdout.readline() == 'ready\\n'\n"
              "print(p.pid, flush=True)\ntime.sleep(120)\n")
    [pid] = _kill_launcher(script)
    t0 = time.monotonic()
    try:
        while _running(pid):
            assert time.monotonic() - t0 < 8.0, "the child outlived its launcher"
            time.sleep(0.05)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _kill_launcher(script: str) -> list[int]:
    """Run ``script`` (it prints its children's pids on one line), then kill it -9."""
    launcher = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True)
    try:
        return [int(p) for p in launcher.stdout.readline().split()]
    finally:
        launcher.kill()
        launcher.wait()
        launcher.stdout.close()


def _running(pid: int) -> bool:
    try:   # a zombie (exited, not reaped yet by whoever adopted it) counts as ended
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False

