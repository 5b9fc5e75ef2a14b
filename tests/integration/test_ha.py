"""Standby masters on a real etcd (Debian's etcd-server, started on free ports in a tmp dir):
three masters elect a leader; kill -9 it and a standby takes over within a bounded time, the
store nodes re-announce what they hold, and clients (given the etcd URL, or the list of the
masters) follow on their own: nothing committed is lost, no byte is wrong."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from kvpool.client import KVClient
from kvpool.common import pki, security
from kvpool.common.addresses import parse_etcd_url
from kvpool.common.errors import KVPoolError, MasterUnavailable
from kvpool.rpc.leader import read_leader
from kvpool.rpc.master_client import MasterClient
from kvpool.tools.cluster import Proc

from .conftest import run_cluster
from .test_master_restart import read_all_when_back

pytestmark = pytest.mark.skipif(shutil.which("etcd") is None,
                                reason="no etcd binary (apt-get install etcd-server)")
ETCD_SERVER = Path(__file__).resolve().parents[2] / "scripts" / "etcd_server.py"

HA_LEASE_TTL_S = 2          # etcd's minimum: a dead leader is replaced in about this long
# Bounds for the test to give up, not performance targets (scripts/bench_failover.py measures).
TAKEOVER_LIMIT_S = 30.0


@pytest.fixture
def etcd(tmp_path):
    """A throwaway etcd (scripts/etcd_server.py, run by path): its ``etcd://HOST:PORT`` URL."""
    with open(tmp_path / "etcd-server.log", "wb") as log:
        server = Proc("etcd", ["--data-dir", str(tmp_path / "etcd")], log,
                      program=[sys.executable, str(ETCD_SERVER)])
        try:
            yield server.wait_ready("etcd")
        finally:
            server.terminate()


@pytest.fixture
def ha(tmp_path, etcd):
    """Three masters electing on ``etcd`` and two store nodes following the leader."""
    yield from run_cluster(tmp_path, masters=3, ha=f"{etcd}/ha-test",
                           master_args=["--ha-lease-ttl", f"{HA_LEASE_TTL_S}s"])


def first_success(op, limit_s: float = TAKEOVER_LIMIT_S) -> float:
    """Retry ``op`` until it succeeds; the seconds that took."""
    started = time.monotonic()
    while True:
        try:
            op()
            return time.monotonic() - started
        except KVPoolError as e:
            assert time.monotonic() - started < limit_s, f"no success within {limit_s}s: {e}"
            time.sleep(0.02)


# Each writer's puts of 16 KiB: 2 x 2,000 x 16 KiB = 64 MiB, with the 8 MiB put first well
# below the two segments' low watermark; ~3 s of puts at one per ~2 ms reaches ~1,500.
WRITER_MAX_PUTS = 2000
WRITER_PAUSE_S = 0.002


def test_leader_killed_standby_takes_over_nothing_lost(ha):
    values = {f"ha-{i}": os.urandom(32 * 1024 + i) for i in range(200)}
    twice = {f"ha2-{i}": os.urandom(64 * 1024) for i in range(20)}
    committed: dict[str, bytes] = {}
    stop = threading.Event()

    def writer(tag: str, master: str) -> None:
        # Paced and capped: every value must fit without eviction (two 64 MiB segments), or
        # "nothing lost" would count evicted objects as lost; unpaced, the writers put 10,000
        # values (160 MiB) in the test's ~3 s once single puts got fast.
        with KVClient(master, timeout_s=5.0) as kv:
            i = 0
            while not stop.is_set() and i < WRITER_MAX_PUTS:
                key, value = f"{tag}-{i}", os.urandom(16 * 1024)
                i += 1
                time.sleep(WRITER_PAUSE_S)
                try:
                    kv.put(key, value)
                except KVPoolError:
                    continue          # failed during the failover: a typed error, fine
                committed[key] = value

    masters_list = ",".join(ha.standbys)    # the other way to find the leader: try them all
    with KVClient(ha.master) as kv:
        assert kv.batch_put(list(values), list(values.values())) == [None] * len(values)
        assert kv.batch_put(list(twice), list(twice.values()), replicas=2) == [None] * len(twice)
        before = kv.stats()
        threads = [threading.Thread(target=writer, args=("etcd", ha.master)),
                   threading.Thread(target=writer, args=("list", masters_list))]
        for t in threads:
            t.start()
        try:
            time.sleep(1.0)
            old = ha.leader()
            killed = time.monotonic()
            ha.kill_leader()
            serving_s = first_success(lambda: kv.put(f"probe-{time.monotonic()}", b"p" * 100))
            rebuilt_s = time.monotonic() - killed + read_all_when_back(kv, {**values, **twice})
            time.sleep(1.0)          # the writers carry on through the new leader
        finally:
            stop.set()
            for t in threads:
                t.join()
        new = ha.leader()
        print(f"\nleader kill -9 -> first successful put: {serving_s:.2f} s; -> all "
              f"{len(values) + len(twice)} objects readable: {rebuilt_s:.2f} s "
              f"(etcd lease {HA_LEASE_TTL_S} s); {len(committed)} puts acknowledged meanwhile")
        assert new != old and not ha.standbys[old].alive()
        assert serving_s < TAKEOVER_LIMIT_S
        after = kv.stats()
        assert after.objects >= before.objects + len(committed)
        # Both replicas of the replicated objects came back to the new leader's index.
        assert sum(s.objects for s in after.segments) >= len(values) + 2 * len(twice)
        # Every put acknowledged before, during and after the failover, byte for byte.
        assert {k for k in committed if k.startswith("etcd-")}, "the etcd client never wrote"
        assert {k for k in committed if k.startswith("list-")}, "the list client never wrote"
        read_all_when_back(kv, committed)


def test_standby_refuses_naming_the_leader(ha):
    leader = ha.leader()
    standby = next(a for a in ha.standbys if a != leader)
    with (MasterClient(standby, retries=0) as mc,
          pytest.raises(MasterUnavailable, match=f"not the leader; leader is {leader}")):
        mc.stats()
    # The same refusal reaches a user of the CLI, as one line.
    r = subprocess.run([sys.executable, "-m", "kvpool", "stat", "--master", standby],
                       capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 1 and "not the leader; leader is" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    # A client given the standby first follows its hint to the leader.
    with KVClient(f"{standby},{leader}") as kv:
        kv.put("via-standby", b"v" * 500)
        assert kv.get("via-standby", verify=True) == b"v" * 500
        assert kv.master_address == leader


def test_paused_leader_is_fenced_and_exits(ha):
    """A leader that stalls past its lease (SIGSTOP: a long pause) must not serve when it wakes:
    its own clock says the lease lapsed, it refuses every call, and it exits."""
    with KVClient(ha.master) as kv:
        kv.put("before-pause", b"b" * 1000)
        old = ha.leader()
        proc = ha.standbys[old].popen
        proc.send_signal(signal.SIGSTOP)
        try:
            first_success(lambda: kv.put("during-pause", b"d" * 1000))
            assert ha.leader() != old
        finally:
            proc.send_signal(signal.SIGCONT)
        with MasterClient(old, retries=0, timeout_s=5.0) as mc:
            try:
                mc.stats()
                pytest.fail("the old leader served a call after its lease lapsed")
            except MasterUnavailable as e:
                # Refused; gone (UNAVAILABLE); exiting while the call was in flight (CANCELLED,
                # as its server stops); or, on a loaded host, still waking when the call ends.
                assert any(why in str(e) for why in (
                    "not the leader", "UNAVAILABLE", "CANCELLED", "DEADLINE_EXCEEDED")), e
        assert proc.wait(timeout=TAKEOVER_LIMIT_S) == 1
        for key, value in (("before-pause", b"b" * 1000), ("during-pause", b"d" * 1000)):
            assert read_all_when_back(kv, {key: value}) >= 0


@pytest.mark.parametrize("url, message", [
    ("etcd:/127.0.0.1:2379", "invalid etcd URL"),
    ("http://127.0.0.1:2379", "invalid etcd URL"),
    ("etcd://127.0.0.1:notaport", "invalid etcd endpoint"),
    ("etcd://127.0.0.1:2379/no/slashes", "invalid etcd URL"),
])
def test_bad_ha_url_is_a_clear_error(url, message):
    for argv in (["master", "--port", "0", "--ha", url],
                 ["store-node", "--master", url, "--segment-size", "1MiB"]):
        r = subprocess.run([sys.executable, "-m", "kvpool", *argv], capture_output=True,
                           text=True, timeout=60, check=False)
        assert r.returncode == 1, (argv, r.stderr)
        assert message in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_ha_needs_an_address_clients_can_dial():
    r = subprocess.run([sys.executable, "-m", "kvpool", "master", "--host", "0.0.0.0",
                        "--port", "0", "--ha", "etcd://127.0.0.1:2379"],
                       capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 1 and "--advertise" in r.stderr and "Traceback" not in r.stderr


def test_leader_whose_key_is_taken_away_steps_down(ha, etcd):
    """An operator deletes the leader key: a standby takes it, and the old leader, seeing the
    key is no longer its own at its next keep-alive, stops serving and exits."""
    import grpc
    from aetcd.rpc import rpc_pb2, rpc_pb2_grpc
    from kvpool.common.addresses import parse_etcd_url
    old = ha.leader()
    with grpc.insecure_channel(etcd.removeprefix("etcd://")) as channel:
        rpc_pb2_grpc.KVStub(channel).DeleteRange(
            rpc_pb2.DeleteRangeRequest(key=parse_etcd_url(ha.master).key), timeout=5.0)
    assert ha.standbys[old].popen.wait(timeout=TAKEOVER_LIMIT_S) == 1
    assert ha.leader() != old
    with KVClient(ha.master) as kv:
        first_success(lambda: kv.put("after-takeover", b"t" * 100))
        assert kv.get("after-takeover") == b"t" * 100


def test_masters_elect_over_etcd_with_tls_and_clients_follow(tmp_path):
    """etcds://: etcd serves TLS with a certificate of the cluster's CA and requires every
    client's; masters campaign and clients and nodes find the leader with their own
    credentials. A peer without a certificate of that CA gets nothing from etcd."""
    creds = tmp_path / "creds"
    pki.make_ca(creds)
    with open(tmp_path / "etcd-server.log", "wb") as log:
        server = Proc("etcd", ["--data-dir", str(tmp_path / "etcd"), "--credentials-dir",
                               str(creds)], log, program=[sys.executable, str(ETCD_SERVER)])
        try:
            url = server.wait_ready("etcd")
            assert url.startswith("etcds://")
            for c in run_cluster(tmp_path, masters=2, ha=f"{url}/tls-test",
                                 credentials_dir=creds,
                                 master_args=["--ha-lease-ttl", f"{HA_LEASE_TTL_S}s"]):
                # local_reads=False: the get must find the new leader, not the node's index
                with KVClient(c.master, local_reads=False) as kv:
                    kv.put("over-tls", b"t" * 4096)
                    c.kill_leader()
                    first_success(lambda: kv.get("over-tls"))
                    assert kv.get("over-tls") == b"t" * 4096
                parsed = parse_etcd_url(f"{url}/tls-test")
                with pytest.raises(MasterUnavailable):   # plain text to a TLS etcd
                    read_leader(parse_etcd_url(url.replace("etcds://", "etcd://")), 2.0)
                pki.make_ca(tmp_path / "other")
                stranger = security.load(pki.issue(tmp_path / "other", "admin", "x"))
                with pytest.raises(MasterUnavailable):   # a certificate of another CA
                    read_leader(parsed, 2.0, stranger)
                assert read_leader(parsed, 2.0, security.load(c.client_credentials)) == \
                    c.leader()
        finally:
            server.terminate()


def test_a_master_on_etcds_needs_credentials(tmp_path):
    r = subprocess.run([sys.executable, "-m", "kvpool", "master", "--port", "0", "--insecure",
                        "--ha", "etcds://127.0.0.1:1"], capture_output=True, text=True,
                       timeout=60, check=False)
    assert r.returncode != 0 and "--credentials" in r.stderr and "Traceback" not in r.stderr


def test_token_clients_follow_the_leaders_token_port(tmp_path, etcd):
    """Standby masters with --tokens: the leader publishes its token port in etcd beside its
    address; a token client given the etcd URL dials it, and after the leader is killed, the
    new leader's (a standby's hint names the certificate port, which a token client skips)."""
    creds = tmp_path / "creds"
    pki.make_ca(creds)
    token = pki.make_token(creds, "client", "tenant-t")
    for c in run_cluster(tmp_path, masters=2, ha=f"{etcd}/tokens-test", credentials_dir=creds,
                         master_args=["--ha-lease-ttl", f"{HA_LEASE_TTL_S}s", "--tokens",
                                      str(creds / "tokens.yaml")]):
        with KVClient(c.master, timeout_s=5.0, credentials=str(token),
                      local_reads=False) as kv:   # the get must reach the new leader
            kv.put("by-token", b"t" * 4096)
            first = kv._master.address
            assert first != c.leader()          # the leader's token port, not its own
            c.kill_leader()
            first_success(lambda: kv.get("by-token"))
            assert kv.get("by-token") == b"t" * 4096
            assert kv._master.address not in (first, c.leader())
            kv.put("after-failover", b"a" * 4096)
