"""kvpool's image running a master and two store nodes, each in a container of its own
(testcontainers), and a client on this host, as deploy/compose runs them: every kvpool port is
published under its own number and every process advertises the docker host's address (here the
namespace's), so the client reaches the nodes where the master says they are. The nodes keep a
disk tier on a named volume; one is killed (SIGKILL), its container removed, and a new one
started on the same volume under the same node id keeps what the old one had committed there."""

from __future__ import annotations

import contextlib
import uuid

import numpy as np
import pytest
from kvpool.client import KVClient

from .conftest import disk_manifest_keys, http_get, samples, wait_for

pytestmark = [pytest.mark.docker, pytest.mark.timeout(1200)]   # a cold build may come first

BLOCK = 256 << 10
DRAM = 4 << 20            # a node's DRAM segment: 16 blocks, demoting past 3/4 of it
DISK_PATH = "/var/lib/kvpool/disk"
MASTER = ["master", "--host", "0.0.0.0", "--port", "50051", "--lookup-port", "50052",
          "--metrics-port", "9400", "--high-watermark", "0.75", "--low-watermark", "0.5",
          "--node-ttl", "3s", "--lease-ttl", "1s", "--put-timeout", "10s",
          "--insecure"]   # as deploy/'s compose file: containers on their own network, no CA
NODES = {"node-1": (50060, 9401), "node-2": (50061, 9411)}   # data port, metrics port


def value(i: int, size: int = BLOCK) -> bytes:
    return np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8).tobytes()


class Cluster:
    """A master and the store nodes of NODES in containers on one network, each ready (its
    /readyz says so) when started; the nodes' disk tiers on named volumes, kept while the test
    runs, so a node started again under its name finds its disk."""

    def __init__(self, docker, network, stack: contextlib.ExitStack):
        from testcontainers.core.container import DockerContainer
        self._container, self._docker, self._network = DockerContainer, docker, network
        self.running: dict[str, object] = {}
        self.volumes = {name: f"kvptest-{name}-{uuid.uuid4().hex[:8]}" for name in NODES}
        # Unwound in reverse: volumes after the containers using them.
        stack.callback(lambda: [docker.run("volume", "rm", "-f", v, check=False)
                                for v in self.volumes.values()])
        stack.callback(lambda: [c.stop() for c in self.running.values()])

    def _start(self, name: str, command: list[str], ports: tuple[int, ...], alias: str = ""):
        from testcontainers.core.wait_strategies import HttpWaitStrategy
        c = self._container(self._docker.image, command=command).with_network(self._network)
        for p in ports:   # the same number outside: it is what the process advertises
            c.with_bind_ports(p, p)
        if alias:
            c.with_network_aliases(alias)
        if name in self.volumes:
            c.with_volume_mapping(self.volumes[name], "/var/lib/kvpool", "rw")
        c.waiting_for(HttpWaitStrategy(ports[-1], "/readyz").with_startup_timeout(60))
        self.running[name] = c
        c.start()
        return c

    def start_master(self):
        return self._start("master", MASTER, (50051, 50052, 9400), alias="master")

    def start_node(self, name: str):
        data_port, metrics_port = NODES[name]
        return self._start(name, [
            "store-node", "--master", "master:50051", "--node-id", name,
            "--host", "0.0.0.0", "--port", str(data_port), "--advertise-host", self._docker.ns_ip,
            "--metrics-port", str(metrics_port), "--no-shm", "--heartbeat-interval", "200ms",
            "--segment-size", str(DRAM), "--disk-path", DISK_PATH, "--disk-size", "64MiB"],
            (data_port, metrics_port))


@pytest.fixture
def cluster(docker_daemon):
    from testcontainers.core.network import Network
    with contextlib.ExitStack() as stack:
        c = Cluster(docker_daemon, stack.enter_context(Network()), stack)
        c.start_master()
        for name in NODES:
            c.start_node(name)
        yield c


def test_a_host_client_puts_and_reads_back_byte_for_byte(docker_daemon, cluster):
    ip = docker_daemon.ns_ip
    values = {f"obj-{i}": value(i, 1000 + i * 40_000) for i in range(12)}
    with KVClient(f"{ip}:50051") as kv:
        for key, v in values.items():
            kv.put(key, v)
        assert kv.batch_get(list(values), verify=True) == list(values.values())
        assert kv.get("obj-3") == values["obj-3"]
        # The replicas are where the nodes advertised them: the docker host's published ports.
        where = {v.replicas[0].node.tcp_endpoint for v in kv._master.locate(list(values)).views()}
        assert where <= {f"{ip}:{port}" for port, _ in NODES.values()}, where

    status, text = http_get(f"http://{ip}:9400/metrics")
    assert status == 200
    master = samples(text)
    assert master['kvpool_master_objects{state="complete"}'] == len(values)
    assert master["kvpool_master_nodes"] == 2
    assert master["kvpool_master_leader"] == 1
    assert http_get(f"http://{ip}:9400/readyz")[0] == 200
    for name, (_, metrics_port) in NODES.items():
        node = samples(http_get(f"http://{ip}:{metrics_port}/metrics")[1])
        assert node[f'kvpool_node_ready{{node="{name}"}}'] == 1
        assert http_get(f"http://{ip}:{metrics_port}/readyz") == (200, "ready\n")
        assert http_get(f"http://{ip}:{metrics_port}/healthz")[0] == 200


def test_a_killed_node_container_keeps_what_its_disk_tier_committed(docker_daemon, cluster):
    d, ip = docker_daemon, docker_daemon.ns_ip
    keys = [f"k{i}" for i in range(64)]   # 16 MiB: twice what both DRAM segments hold
    with KVClient(f"{ip}:50051") as kv:
        for i, key in enumerate(keys):   # one by one: DRAM fills, the master demotes between
            kv.put(key, value(i))
        wait_for(lambda: kv.stats().demotions > 0 and _dram_used(kv) <= 0.75 * 2 * DRAM,
                 what="DRAM to settle under its high watermark")
        views = kv._master.locate(keys).views()
        place = {k: (v.replicas[0].node.node_id, v.replicas[0].tier) for k, v in zip(keys, views)}
        on_disk = [k for k in keys if place[k] == ("node-1", "disk")]
        on_node_2 = [k for k in keys if place[k][0] == "node-2"]
        assert len(on_disk) >= 8, place
        # Committed on disk: in the node's manifest log, which a restart replays.
        node = cluster.running["node-1"].get_wrapped_container()
        wait_for(lambda: set(on_disk) <= disk_manifest_keys(d, node.id, DISK_PATH),
                 what="node-1's disk manifest to hold its disk-tier objects")

        node.kill()   # SIGKILL: no clean stop, no fsync
        node.reload()
        assert (node.attrs["State"]["Running"], node.attrs["State"]["ExitCode"]) == (False, 137)
        cluster.running.pop("node-1").stop()   # the container goes; its volume stays
        # A new container on the same volume, with the same --node-id; ready once it is mounted
        # again, its disk tier's objects announced, its manifest stream open.
        cluster.start_node("node-1")
        assert all(kv.batch_exists(on_disk))
        survivors = on_disk + on_node_2
        got = kv.batch_get(survivors, verify=True)
        assert [g == value(int(k[1:])) for k, g in zip(survivors, got)] == [True] * len(got)
    print(f"{len(on_disk)} objects on node-1's disk tier survived its SIGKILL "
          f"(and {len(on_node_2)} on node-2)")


def _dram_used(kv: KVClient) -> int:
    return sum(g.used_bytes for g in kv.stats().segments if g.segment.tier == 0)
