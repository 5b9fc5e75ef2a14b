"""Hosts as network namespaces: a master in the root namespace on a private bridge, each store
node in a namespace of its own behind a veth pair, faults injected with iptables (``tc netem``
does not exist here) or by taking a link down.

Addresses are in 10.77.X.0/24 (X picked free per run) on a bridge only these namespaces are
attached to: no traffic leaves the machine. Every namespace, veth, bridge, iptables rule (they
live in the node namespaces and go with them) and process is removed when the test ends,
however it ends.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import time

import pytest
from kvpool.common import pki, security
from kvpool.tools.cluster import Proc

NODE_TTL_S = 5.0
HEARTBEAT_S = 0.3
MASTER_ARGS = ["--node-ttl", f"{NODE_TTL_S}s", "--put-timeout", "5s", "--quarantine", "1s",
               "--lease-ttl", "1s"]
NODE_ARGS = ["--heartbeat-interval", f"{HEARTBEAT_S}s", "--segment-size", "64MiB",
             # tcp only: shm would "work" across namespaces (one kernel, one boot id), so the
             # network faults would not be on the data path at all.
             "--no-shm", "--no-rdma", "--scrub-rate", "0"]


def _why_no_netns() -> str:
    if os.geteuid() != 0:
        return "chaos tests need root (network namespaces, iptables)"
    for tool in ("ip", "iptables"):
        if shutil.which(tool) is None:
            return f"chaos tests need `{tool}` (apt install iproute2 iptables)"
    probe = f"kvprobe{os.getpid() % 100000}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True,
                          check=False)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    try:
        rule = subprocess.run(["ip", "netns", "exec", probe, "iptables", "-A", "INPUT", "-m",
                               "statistic", "--mode", "random", "--probability", "0.2", "-j",
                               "DROP"], capture_output=True, text=True, check=False)
        if rule.returncode != 0:
            return f"iptables -m statistic does not work here: {rule.stderr.strip()}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True, check=False)
    return ""


def _sh(*argv: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = ["ip", "netns", "exec", ns, *argv] if ns else list(argv)
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=False)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {r.stderr.strip()}")
    return r


class Hosts:
    """A master (root namespace) and ``nodes`` store nodes, each in its own namespace."""

    def __init__(self, tmp_path, nodes: int = 3):
        tag = f"{random.randrange(16**4):04x}"
        self.bridge = f"kv{tag}br"
        self.ns = [f"kv{tag}n{i}" for i in range(nodes)]
        self.host_if = [f"kv{tag}h{i}" for i in range(nodes)]
        self.node_if = [f"kv{tag}p{i}" for i in range(nodes)]
        self.names = [f"node{i}" for i in range(nodes)]
        used = _sh("ip", "-4", "-o", "addr").stdout
        free = [x for x in range(1, 255) if f"10.77.{x}." not in used]
        self.net = f"10.77.{random.choice(free)}"
        self.master_ip = f"{self.net}.1"
        self.node_ip = [f"{self.net}.{10 + i}" for i in range(nodes)]
        self.creds = tmp_path / "credentials"   # the cluster's own CA (SECURITY.md)
        self.log_dir = tmp_path / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._logs: list = []
        self.master = ""
        self.master_proc: Proc | None = None
        self.nodes: dict[str, Proc] = {}

    # -- life cycle ------------------------------------------------------------------------

    def start(self) -> None:
        try:
            _sh("ip", "link", "add", self.bridge, "type", "bridge")
            _sh("ip", "addr", "add", f"{self.master_ip}/24", "dev", self.bridge)
            _sh("ip", "link", "set", self.bridge, "up")
            for ns, h, p, ip in zip(self.ns, self.host_if, self.node_if, self.node_ip):
                _sh("ip", "netns", "add", ns)
                _sh("ip", "link", "add", h, "type", "veth", "peer", "name", p)
                _sh("ip", "link", "set", p, "netns", ns)
                _sh("ip", "link", "set", h, "master", self.bridge)
                _sh("ip", "link", "set", h, "up")
                _sh("ip", "addr", "add", f"{ip}/24", "dev", p, ns=ns)
                _sh("ip", "link", "set", p, "up", ns=ns)
                _sh("ip", "link", "set", "lo", "up", ns=ns)
            master_creds = pki.make_local(self.creds, self.master_ip)
            self.master_proc = Proc("master", ["master", "--host", self.master_ip, "--port", "0",
                                               "--credentials", str(master_creds),
                                               *MASTER_ARGS], self._log("master"))
            self.master = self.master_proc.wait_ready("master")
            security.register([self.master], self.creds)   # the tests' clients find them
            for i in range(len(self.ns)):
                self.start_node(i)
        except BaseException:
            self.stop()
            raise

    def start_node(self, i: int) -> None:
        name = self.names[i]
        proc = Proc(name, ["store-node", "--master", self.master, "--host", self.node_ip[i],
                           "--node-id", name, "--credentials",
                           str(pki.ensure(self.creds, "node", name)), *NODE_ARGS],
                    self._log(name),
                    launcher=["ip", "netns", "exec", self.ns[i]])
        self.nodes[name] = proc
        proc.wait_ready("store-node")

    def stop(self) -> None:
        """Kill every process, remove every namespace (with its veth and rules), the bridge."""
        for proc in list(self.nodes.values()) + [self.master_proc]:
            if proc is not None:
                try:
                    proc.terminate(timeout_s=5.0)
                except (OSError, subprocess.SubprocessError):
                    proc.kill()
        self.nodes.clear()
        self.master_proc = None
        if self.master:
            security.unregister([self.master])
        for ns in self.ns:
            _sh("ip", "netns", "del", ns, check=False)
        for h in self.host_if:   # gone with their peers; left only by a half-done start
            _sh("ip", "link", "del", h, check=False)
        _sh("ip", "link", "del", self.bridge, check=False)
        for f in self._logs:
            f.close()
        self._logs.clear()

    def leftovers(self) -> list[str]:
        """Namespaces and links of this run still present (must be none after stop)."""
        names = _sh("ip", "netns", "list").stdout + _sh("ip", "-o", "link").stdout
        return [n for n in [*self.ns, *self.host_if, self.bridge] if n in names]

    def _log(self, name: str):
        f = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 - open for the child's life
        self._logs.append(f)
        return f

    # -- faults ----------------------------------------------------------------------------

    def index(self, name: str) -> int:
        return self.names.index(name)

    def partition(self, name: str, how: str = "iptables") -> None:
        """Cut the node off: every packet in and out dropped, or its link down."""
        i = self.index(name)
        if how == "link":
            _sh("ip", "link", "set", self.node_if[i], "down", ns=self.ns[i])
            return
        _sh("iptables", "-A", "INPUT", "-i", self.node_if[i], "-j", "DROP", ns=self.ns[i])
        _sh("iptables", "-A", "OUTPUT", "-o", self.node_if[i], "-j", "DROP", ns=self.ns[i])

    def lossy(self, name: str, probability: float) -> None:
        """Drop this share of the node's packets, in and out, at random."""
        i = self.index(name)
        for chain, flag in (("INPUT", "-i"), ("OUTPUT", "-o")):
            _sh("iptables", "-A", chain, flag, self.node_if[i], "-m", "statistic", "--mode",
                "random", "--probability", str(probability), "-j", "DROP", ns=self.ns[i])

    def heal(self, name: str) -> None:
        """Undo every fault on the node: rules flushed, link up."""
        i = self.index(name)
        _sh("iptables", "-F", "INPUT", ns=self.ns[i])
        _sh("iptables", "-F", "OUTPUT", ns=self.ns[i])
        _sh("ip", "link", "set", self.node_if[i], "up", ns=self.ns[i])

    def logs_have_traceback(self) -> list[str]:
        return [p.name for p in self.log_dir.glob("*.log") if "Traceback" in p.read_text()]


@pytest.fixture
def hosts(tmp_path):
    """Started Hosts (master + 3 nodes in namespaces); everything removed afterwards."""
    why = _why_no_netns()
    if why:
        pytest.skip(why)
    h = Hosts(tmp_path)
    h.start()
    try:
        yield h
    finally:
        h.stop()
        left = h.leftovers()
        assert not left, f"teardown left {left}"
    assert not h.logs_have_traceback(), f"traceback in {h.logs_have_traceback()}"


def wait_for(predicate, timeout_s: float, what: str, interval_s: float = 0.2) -> float:
    """Poll until ``predicate()`` is true; return the seconds it took; fail after the timeout."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"{what}: not within {timeout_s:.0f} s")
        time.sleep(interval_s)
    return time.monotonic() - start
