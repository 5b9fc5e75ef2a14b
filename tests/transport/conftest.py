"""Fixtures for the transport contract suite: a real data server in a child process.

The node runs in a subprocess (``serve_node.py``) so that sockets, fd passing and shared
mappings cross a process boundary for real, and so that a test can SIGKILL it.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from kvpool.client.transport.base import Transport
from kvpool.client.transport.registry import create_transports
from kvpool.common.types import Extent, NodeEndpoints, Replica, SegmentInfo
from kvpool.net.rdma_probe import unavailable_reason

SERVE_NODE = Path(__file__).with_name("serve_node.py")
STARTUP_TIMEOUT_S = 30.0
# rdma runs for real on soft-RoCE (bash scripts/softroce/test.sh); elsewhere it skips, saying why.
SCHEMES = ("shm", "tcp", pytest.param("rdma", marks=pytest.mark.rdma))


@dataclass
class NodeProcess:
    """A running child data server and how to address its segments."""

    proc: subprocess.Popen
    node: NodeEndpoints
    segments: list[SegmentInfo]
    stderr_path: Path

    def replica(self, segment: int, offset: int, length: int) -> Replica:
        seg = self.segments[segment]
        return Replica(self.node, Extent(seg.segment_id, offset, length),
                       rdma_addr=seg.rdma_addr, rdma_rkey=seg.rdma_rkey,
                       rdma_length=seg.size_bytes if seg.rdma_rkey else 0)

    def request_counts(self) -> dict[str, int]:
        """The node's data-server request counts so far, by op name."""
        self.proc.stdin.write(b"stats\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], STARTUP_TIMEOUT_S)
        line = self.proc.stdout.readline() if ready else b""
        if not line:
            raise RuntimeError(f"node gave no stats:\n{self.stderr()}")
        return json.loads(line)

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        self.proc.send_signal(sig)
        if sig in (signal.SIGKILL, signal.SIGTERM):
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        """Graceful: close its stdin (it stops its server and exits); SIGTERM, SIGKILL if not."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)    # in case a test stopped it
        if self.proc.stdin:
            self.proc.stdin.close()
        for escalate in (self.proc.terminate, self.proc.kill):
            try:
                self.proc.wait(timeout=10)
                break
            except subprocess.TimeoutExpired:
                escalate()
        self.proc.wait()
        if self.proc.stdout:
            self.proc.stdout.close()


def start_node(workdir: Path, *args: str) -> NodeProcess:
    """Start serve_node.py and wait for its endpoints line."""
    workdir.mkdir(parents=True, exist_ok=True)
    stderr_path = workdir / f"node-{os.urandom(4).hex()}.stderr"
    with open(stderr_path, "wb") as stderr:
        proc = subprocess.Popen([sys.executable, str(SERVE_NODE), *args], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=stderr)
    ready, _, _ = select.select([proc.stdout], [], [], STARTUP_TIMEOUT_S)
    line = proc.stdout.readline() if ready else b""
    if not line:
        proc.kill()
        proc.wait()
        raise RuntimeError(f"node did not start:\n{stderr_path.read_text(errors='replace')}")
    info = json.loads(line)
    node = NodeEndpoints(node_id=info["node_id"], boot_id=info["boot_id"],
                         tcp_endpoint=info["tcp_endpoint"], shm_endpoint=info["shm_endpoint"],
                         rdma_device=info["rdma_device"], rdma_gid=info["rdma_gid"],
                         rdma_port=info["rdma_port"])
    segments = [SegmentInfo(s["segment_id"], s["size_bytes"], rdma_addr=s["rdma_addr"],
                            rdma_rkey=s["rdma_rkey"]) for s in info["segments"]]
    return NodeProcess(proc, node, segments, stderr_path)


def assert_clean_stderr(node: NodeProcess) -> None:
    text = node.stderr()
    assert "Traceback" not in text, text
    assert "connection_handler_failed" not in text, text


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    """One shared node per test module (tests use it without killing it)."""
    proc = start_node(tmp_path_factory.mktemp("node"))
    yield proc
    proc.stop()
    assert proc.proc.returncode == 0, proc.stderr()
    assert_clean_stderr(proc)


@pytest.fixture
def fresh_node(tmp_path: Path) -> Iterator[NodeProcess]:
    """A node of this test's own, which the test may kill."""
    proc = start_node(tmp_path)
    yield proc
    proc.stop()
    assert "Traceback" not in proc.stderr(), proc.stderr()


@pytest.fixture(params=SCHEMES)
def scheme(request: pytest.FixtureRequest) -> str:
    if request.param == "rdma" and (reason := unavailable_reason()):
        pytest.skip(f"rdma: {reason} (run bash scripts/softroce/test.sh)")
    return request.param


@pytest.fixture
def make_transport(scheme: str) -> Iterator:
    """Build transports of the current scheme (with constructor options); closed after."""
    made: list[Transport] = []

    def make(**options) -> Transport:
        (transport,) = create_transports([scheme], options={scheme: options} if options else None)
        made.append(transport)
        return transport

    yield make
    for transport in made:
        transport.close()


@pytest.fixture
def transport(make_transport) -> Transport:
    return make_transport()
