"""A store node's lifecycle: allocate segments -> serve data -> mount on the master ->
heartbeat (mounting again whenever the master has forgotten us) -> unmount -> release."""

from __future__ import annotations

import socket
import threading
import time
import uuid
from collections.abc import Sequence

from kvpool.client.master_client import MasterClient
from kvpool.common.config import format_size
from kvpool.common.errors import KVPoolError, MasterUnavailable, NoSpace, UnknownNode
from kvpool.common.host import local_boot_id
from kvpool.common.logging import get_logger
from kvpool.common.types import NodeEndpoints, SegmentInfo
from kvpool.store_node.data_server import DataServer
from kvpool.store_node.memory import Segment, create_dram_segment

log = get_logger(__name__)


class StoreNode:
    """Pools DRAM segments into the cluster. ``start()`` returns once every segment is mounted."""

    def __init__(self, master: str, segment_sizes: Sequence[int], *, host: str = "127.0.0.1",
                 port: int = 0, node_id: str | None = None, heartbeat_interval_s: float = 1.0,
                 shm: bool = True, advertise_host: str | None = None,
                 rdma_device: str | bool | None = None):
        """``host``/``port``: where the tcp data server listens (port 0 = any free port);
        ``advertise_host``: the address clients should dial, if not ``host`` (e.g. 0.0.0.0).
        ``rdma_device``: register the segments with this RDMA device (an error if missing);
        None: with the first device found, if any; False: never offer rdma."""
        if not segment_sizes:
            raise ValueError("a store node needs at least one segment")
        self.node_id = node_id or f"{socket.gethostname()}-{uuid.uuid4().hex[:8]}"
        self._sizes = list(segment_sizes)
        self._host, self._port, self._shm = host, port, shm
        self._advertise = advertise_host
        self._rdma_device = rdma_device
        self._rdma = None                       # store_node.rdma.NodeRDMA where enabled
        self._published: dict[str, SegmentInfo] = {}   # as mounted: with the RDMA region
        self._interval_s = heartbeat_interval_s
        self._master = MasterClient(master, timeout_s=max(1.0, 2 * heartbeat_interval_s))
        self.segments: dict[str, Segment] = {}
        self._server: DataServer | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.endpoints: NodeEndpoints | None = None

    def start(self, mount_timeout_s: float = 30.0) -> None:
        """Allocate, serve, mount (retrying while the master is not reachable yet), heartbeat."""
        _check_memory(sum(self._sizes))
        try:
            for i, size in enumerate(self._sizes):
                seg = create_dram_segment(self.node_id, i, size)
                self.segments[seg.info.segment_id] = seg
                self._published[seg.info.segment_id] = seg.info
            if self._rdma_device is not False:
                from kvpool.store_node.rdma import open_node_rdma
                self._rdma = open_node_rdma(self._rdma_device,
                                            required=self._rdma_device is not None)
            if self._rdma is not None:
                for sid, seg in self.segments.items():
                    self._published[sid] = self._rdma.register(seg)
            self._server = DataServer(self.segments, self._host, self._port, shm=self._shm,
                                      rdma=self._rdma)
            self._server.start()
            host, _, port = self._server.tcp_endpoint.rpartition(":")
            self.endpoints = NodeEndpoints(
                node_id=self.node_id, boot_id=local_boot_id(),
                tcp_endpoint=f"{self._advertise or host}:{port}",
                shm_endpoint=self._server.shm_endpoint)
            if self._rdma is not None:
                self.endpoints = self._rdma.advertise(self.endpoints)
            deadline = time.monotonic() + mount_timeout_s
            while True:
                try:
                    self._mount_all()
                    break
                except MasterUnavailable as e:
                    if time.monotonic() > deadline:
                        raise MasterUnavailable(f"could not mount on the master within "
                                                f"{mount_timeout_s:.0f}s: {e}") from None
                    log.warning("master_unreachable_retrying", error=str(e))
                    time.sleep(0.5)
        except BaseException:
            self.stop(unmount=False)
            raise
        self._thread = threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True)
        self._thread.start()
        log.info("store_node_started", node=self.node_id, tcp=self.endpoints.tcp_endpoint,
                 shm=bool(self.endpoints.shm_endpoint),
                 rdma=self.endpoints.rdma_device or None, segments=len(self.segments),
                 capacity_bytes=sum(self._sizes))

    def _mount_all(self) -> None:
        for sid in self.segments:
            self._master.mount_segment(self.endpoints, self._published[sid])

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self._master.heartbeat(self.node_id)
            except UnknownNode:
                # The master declared us dead or restarted: our old objects are gone from its
                # index, so the space is mounted again as empty.
                log.warning("master_forgot_node_remounting", node=self.node_id)
                try:
                    self._mount_all()
                except KVPoolError as e:
                    log.warning("remount_failed", error=str(e))
            except KVPoolError as e:
                log.warning("heartbeat_failed", error=str(e))

    def stop(self, unmount: bool = True) -> None:
        """Unmount (best effort), stop serving, release memory. Idempotent."""
        self._stop.set()
        if self._thread:
            self._thread.join()
            self._thread = None
        if unmount and self.endpoints:
            for sid in list(self.segments):
                try:
                    self._master.unmount_segment(self.node_id, sid)
                except KVPoolError as e:
                    log.warning("unmount_failed", segment=sid, error=str(e))
        if self._server:
            self._server.stop()
            self._server = None
        if self._rdma is not None:   # deregister before the memory goes
            self._rdma.close()
            self._rdma = None
        for seg in self.segments.values():
            seg.close()
        self.segments.clear()
        self._master.close()
        log.info("store_node_stopped", node=self.node_id)


def _check_memory(total_bytes: int) -> None:
    """Refuse segments larger than the memory available: populating them would summon the OOM
    killer instead of giving an error."""
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        available = int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return
    if total_bytes > available:
        raise NoSpace(f"segments of {format_size(total_bytes)} do not fit in the "
                      f"{format_size(available)} of memory available on this host; "
                      "use a smaller --segment-size")
