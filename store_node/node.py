"""A store node's lifecycle: allocate segments -> serve data -> mount on the master ->
heartbeat (keeping the manifest of committed objects; when the master has forgotten us, mounting
again and re-announcing the manifest) -> unmount -> release."""

from __future__ import annotations

import socket
import threading
import time
import uuid
from collections.abc import Sequence

from kvpool.client.master_client import MasterClient
from kvpool.common.config import format_size
from kvpool.common.errors import Conflict, KVPoolError, MasterUnavailable, NoSpace, UnknownNode
from kvpool.common.host import local_boot_id
from kvpool.common.logging import get_logger
from kvpool.common.types import NodeEndpoints, SegmentInfo
from kvpool.store_node.data_server import DataServer
from kvpool.store_node.manifest import Manifest
from kvpool.store_node.memory import Segment, create_dram_segment
from kvpool.store_node.scrubber import Scrubber

log = get_logger(__name__)
# Objects per AnnounceObjects call: ~100 bytes each on the wire, well under gRPC's limit.
ANNOUNCE_BATCH = 16384
# The scrubber's default pace: a 16 GiB node is re-checked every ~4 minutes, for ~0.3% of a
# core (CRC-32C runs at ~20 GB/s).
DEFAULT_SCRUB_BYTES_PER_S = 64 << 20
# The manifest stream is re-opened this often: every RPC has a deadline, streams too.
WATCH_DEADLINE_S = 60.0


class StoreNode:
    """Pools DRAM segments into the cluster. ``start()`` returns once every segment is mounted."""

    def __init__(self, master: str, segment_sizes: Sequence[int], *, host: str = "127.0.0.1",
                 port: int = 0, node_id: str | None = None, heartbeat_interval_s: float = 1.0,
                 shm: bool = True, advertise_host: str | None = None,
                 rdma_device: str | bool | None = None,
                 scrub_bytes_per_s: int = DEFAULT_SCRUB_BYTES_PER_S,
                 scrub_interval_s: float = 60.0):
        """``host``/``port``: where the tcp data server listens (port 0 = any free port);
        ``advertise_host``: the address clients should dial, if not ``host`` (e.g. 0.0.0.0).
        ``rdma_device``: register the segments with this RDMA device (an error if missing);
        None: with the first device found, if any; False: never offer rdma.
        ``scrub_bytes_per_s``: how fast the scrubber re-checks idle objects' checksums (0 =
        never); ``scrub_interval_s``: its rest between passes."""
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
        self.manifest = Manifest()
        self._announcing = False   # mounted as recovering; the announcement is not done yet
        self._watcher: threading.Thread | None = None
        self._scrubber = Scrubber(self.manifest, self.segments, self._report_corrupt,
                                  scrub_bytes_per_s, scrub_interval_s) \
            if scrub_bytes_per_s > 0 else None

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
        self._watcher = threading.Thread(target=self._watch_loop, name="manifest", daemon=True)
        self._watcher.start()
        if self._scrubber is not None:
            self._scrubber.start()
        log.info("store_node_started", node=self.node_id, tcp=self.endpoints.tcp_endpoint,
                 shm=bool(self.endpoints.shm_endpoint),
                 rdma=self.endpoints.rdma_device or None, segments=len(self.segments),
                 capacity_bytes=sum(self._sizes))

    def _mount_all(self, recovering: bool = False) -> None:
        for sid in self.segments:
            self._master.mount_segment(self.endpoints, self._published[sid],
                                       keeps_manifest=True, recovering=recovering)

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                if self._announcing:
                    self._recover()
                committed, removed = self._master.heartbeat(self.node_id)
                self.manifest.apply(committed, removed)
            except UnknownNode:
                # The master declared us dead or restarted: mount again, keeping new objects
                # out of our segments until it has indexed the ones they already hold.
                log.warning("master_forgot_node_remounting", node=self.node_id,
                            objects=len(self.manifest))
                self._announcing = True   # until it is all done, even across failures
                try:
                    self._recover()
                except KVPoolError as e:
                    log.warning("remount_failed", error=str(e))
            except KVPoolError as e:
                log.warning("heartbeat_failed", error=str(e))

    def _watch_loop(self) -> None:
        """Apply the manifest changes the master pushes as it commits (the put path waits for
        them to be sent, so the manifest never misses an acknowledged put); while the stream
        is down, the master keeps them for when it is back."""
        while not self._stop.is_set():
            try:
                for committed, removed in self._master.watch_manifest(self.node_id,
                                                                      WATCH_DEADLINE_S):
                    self.manifest.apply(committed, removed)
            except KVPoolError as e:
                if self._stop.wait(self._interval_s):
                    return
                log.debug("manifest_watch_retrying", error=str(e))

    def _report_corrupt(self, records) -> None:
        self._master.report_corrupt([r.key for r in records], [r.version for r in records],
                                    [r.segment_id for r in records])

    def _recover(self) -> None:
        """Mount every segment as recovering, then re-announce the manifest in batches, the
        last one marked done; objects the master refuses (Conflict) are forgotten. Retried
        from the start if a call fails: mounting and announcing again are harmless."""
        self._mount_all(recovering=True)
        started = time.monotonic()
        batches = self.manifest.batches(ANNOUNCE_BATCH) or [[]]
        indexed = 0
        for n, batch in enumerate(batches, 1):
            results = self._master.announce_objects(self.node_id, batch, done=n == len(batches))
            self.manifest.forget(r.key for r, err in zip(batch, results)
                                 if isinstance(err, Conflict))
            indexed += sum(err is None for err in results)
        self._announcing = False
        log.info("objects_reannounced", node=self.node_id, indexed=indexed,
                 seconds=round(time.monotonic() - started, 3))

    def stop(self, unmount: bool = True) -> None:
        """Unmount (best effort), stop serving, release memory. Idempotent."""
        self._stop.set()
        if self._scrubber is not None:
            self._scrubber.stop()
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
        self._master.close()   # ends the manifest stream
        if self._watcher:
            self._watcher.join(timeout=5.0)
            self._watcher = None
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
