"""A store node's lifecycle: allocate segments -> serve data -> mount on the master ->
heartbeat (keeping the manifest of committed objects; when the master has forgotten us, mounting
again and re-announcing the manifest) -> unmount -> release."""

from __future__ import annotations

import os
import queue
import socket
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvpool.common import security
from kvpool.common.config import format_size
from kvpool.common.errors import (
    Conflict,
    InvalidArgument,
    KVPoolError,
    MasterUnavailable,
    NoSpace,
    UnknownNode,
)
from kvpool.common.host import local_boot_id
from kvpool.common.logging import get_logger
from kvpool.common.loops import RESTART, OnCrash, Supervisor
from kvpool.common.types import Move, NodeEndpoints, SegmentInfo
from kvpool.net.data_tls import server_context as data_tls_context
from kvpool.net.shm_index import IndexWriter, buckets_for
from kvpool.rpc.master_client import MasterClient
from kvpool.store_node.data_server import DataLimits, DataServer
from kvpool.store_node.disk import DiskTier
from kvpool.store_node.manifest import Manifest
from kvpool.store_node.memory import Segment, check_hugepages, create_dram_segment
from kvpool.store_node.scrubber import Scrubber, recheck

log = get_logger(__name__)
# Objects per AnnounceObjects call: ~100 bytes each on the wire, well under gRPC's limit.
ANNOUNCE_BATCH = 16384
# The scrubber's default pace: a 16 GiB node is re-checked every ~4 minutes, for ~0.3% of a
# core (CRC-32C runs at ~20 GB/s).
DEFAULT_SCRUB_BYTES_PER_S = 64 << 20
# The manifest stream is re-opened this often: every RPC has a deadline, streams too.
WATCH_DEADLINE_S = 60.0
# The heartbeat and the manifest watch keep the master's view of this node true: without the
# first the master expires the node (its objects vanish from the index while the data port
# still serves them), without the second the puts it acknowledges on this node wait, and its
# manifest (what a restarted master is told) falls behind them. Both are safe to run again
# after a crash (what a run did not report, the next reports; a message not acknowledged comes
# again), so a crash is retried; one that keeps coming stops the node, so that its supervisor
# starts a fresh one (which re-announces what its disk tier holds) rather than keep a node
# the cluster cannot use.
VITAL = OnCrash(restarts=5, why="a store node that cannot heartbeat or follow its manifest "
                                "must not go on serving")


@dataclass(frozen=True)
class NodeFigures:
    """What a node has done and holds, for its metrics (store_node/metrics.py)."""
    requests: dict[str, int] = field(default_factory=dict)     # data-port/shm requests, by op
    bytes: dict[str, int] = field(default_factory=dict)        # READ/WRITE payload bytes
    connections: dict[str, int] = field(default_factory=dict)  # open now: tcp, shm
    scrubbed_objects: int = 0
    scrubbed_bytes: int = 0
    corrupt_found: int = 0
    segment_bytes: dict[str, int] = field(default_factory=dict)   # committed, per segment


class StoreNode:
    """Pools DRAM segments into the cluster. ``start()`` returns once every segment is mounted."""

    def __init__(self, master: str | MasterClient, segment_sizes: Sequence[int], *,
                 host: str = "127.0.0.1", port: int = 0, node_id: str | None = None,
                 heartbeat_interval_s: float = 1.0,
                 shm: bool = True, advertise_host: str | None = None,
                 rdma_device: str | bool | None = None,
                 scrub_bytes_per_s: int = DEFAULT_SCRUB_BYTES_PER_S,
                 scrub_interval_s: float = 60.0, disk_path: str | None = None,
                 disk_size: int = 0, hbm_size: int = 0, gpu: int = 0,
                 hugepages: bool = False, supervisor: Supervisor | None = None,
                 data_limits: DataLimits | None = None, credentials: str | None = None,
                 data_tls: bool = False):
        """``host``/``port``: where the tcp data server listens (port 0 = any free port);
        ``advertise_host``: the address clients should dial, if not ``host`` (e.g. 0.0.0.0).
        ``rdma_device``: register the segments with this RDMA device (an error if missing);
        None: with the first device found, if any; False: never offer rdma.
        ``scrub_bytes_per_s``: how fast the scrubber re-checks idle objects' checksums (0 =
        never); ``scrub_interval_s``: its rest between passes.
        ``disk_path``/``disk_size``: a disk tier of that size in that directory (its objects
        survive a restart of the node; store_node/disk.py); the node then takes the node id
        the directory was created with, unless ``node_id`` is given (it must match).
        ``hbm_size``: an HBM tier of that size on GPU ``gpu`` (store_node/hbm.py).
        ``hugepages``: the DRAM segments in reserved 2 MiB huge pages (fewer TLB misses on
        every copy; see memory.check_hugepages).
        ``master``: the master's address, or a client of it (a test's, that fails on purpose).
        ``supervisor``: runs the node's loops (common/loops.py; a test's does not exit).
        ``data_limits``: the data server's connection cap, idle timeout and shm trust
        (store_node/data_server.py DataLimits).
        ``credentials``: this node's credentials file (common/security.py; by default found
        as ``resolve`` says); a node certificate names the node id, which ``node_id`` (if
        given) must equal. ``data_tls``: the tcp data port speaks TLS with this node's
        certificate (net/data_tls.py); InvalidArgument without credentials."""
        if not segment_sizes:
            raise ValueError("a store node needs at least one segment")
        # Opened first: a bad directory is an error before any memory is allocated.
        self._disk = DiskTier(disk_path, disk_size, node_id) if disk_path else None
        node_id = node_id or (self._disk.node_id if self._disk else None)
        # Credentials given or named in the environment decide the node id (a node can act
        # only as the node its certificate names); a local cluster's are issued for it.
        creds = None
        if not isinstance(master, MasterClient) and (path := credentials
                                                      or os.environ.get(security.ENV)):
            creds = security.load(path)
            if not credentials and creds.identity.role != "node":
                creds = None   # a client's, in the environment: not this node's
        if creds is not None and creds.identity.role != "node":
            raise InvalidArgument(f"a store node needs node credentials; {creds.path} is "
                             f"{creds.identity}")
        if creds is not None and node_id not in (None, creds.identity.name):
            raise InvalidArgument(f"node id {node_id!r} is not the one {creds.path} names "
                             f"({creds.identity.name!r})")
        node_id = node_id or (creds.identity.name if creds else None)
        self.node_id = node_id or f"{socket.gethostname()}-{uuid.uuid4().hex[:8]}"
        self._sizes = list(segment_sizes)
        self._hugepages = hugepages
        self._hbm_size, self._gpu = hbm_size, gpu
        self._host, self._port, self._shm = host, port, shm
        self._advertise = advertise_host
        self._rdma_device = rdma_device
        self._rdma = None                       # store_node.rdma.NodeRDMA where enabled
        self._data_limits = data_limits
        self._data_tls = None
        if data_tls:
            found = master.credentials if isinstance(master, MasterClient) else \
                creds or security.resolve(master, role="node", name=self.node_id)
            if found is None:
                raise InvalidArgument("--data-tls needs this node's credentials (--credentials, "
                                      "$KVPOOL_CREDENTIALS, or a local cluster's)")
            self._data_tls = data_tls_context(found)
            creds = found      # resolved once: the master client below uses the same
        self._published: dict[str, SegmentInfo] = {}   # as mounted: with the RDMA region
        self._interval_s = heartbeat_interval_s
        self._master = master if isinstance(master, MasterClient) else \
            MasterClient(master, timeout_s=max(1.0, 2 * heartbeat_interval_s),
                         credentials=creds, role="node", identity=self.node_id)
        self._supervisor = supervisor or Supervisor()
        self.segments: dict[str, Segment] = {}
        self._server: DataServer | None = None
        self._stop = threading.Event()
        self._stream_open = threading.Event()   # the manifest stream to the master is open
        self._thread: threading.Thread | None = None
        self.endpoints: NodeEndpoints | None = None
        self.manifest = Manifest()
        self._announcing = False   # mounted as recovering; the announcement is not done yet
        self._watcher: threading.Thread | None = None
        # Moves between tiers the master asked for: done by one thread, reported with the
        # next heartbeat (which the mover wakes as soon as it runs out of work).
        self._moves: queue.Queue[Move] = queue.Queue()
        self._moves_lock = threading.Lock()
        self._moves_done: list[int] = []
        self._moves_failed: list[int] = []
        self._wake = threading.Event()
        self._mover: threading.Thread | None = None
        self._scrubber = Scrubber(self.manifest, self.segments, self._report_corrupt,
                                  scrub_bytes_per_s, scrub_interval_s, self._supervisor) \
            if scrub_bytes_per_s > 0 else None

    def start(self, mount_timeout_s: float = 30.0) -> None:
        """Allocate, serve, mount (retrying while the master is not reachable yet), heartbeat."""
        if self._hugepages:
            check_hugepages(self._sizes)
        else:
            _check_memory(sum(self._sizes))
        try:
            for i, size in enumerate(self._sizes):
                seg = create_dram_segment(self.node_id, i, size, self._hugepages)
                self.segments[seg.info.segment_id] = seg
                self._published[seg.info.segment_id] = seg.info
            if self._hbm_size:
                from kvpool.store_node.hbm import create_hbm_segment
                seg = create_hbm_segment(self.node_id, self._gpu, self._hbm_size)
                self.segments[seg.info.segment_id] = seg
                self._published[seg.info.segment_id] = seg.info
            recovering = False
            if self._disk is not None:
                seg = self._disk.open(self.node_id)
                self.segments[seg.info.segment_id] = seg
                self._published[seg.info.segment_id] = seg.info
                # Objects kept from this node's previous life: announced before new ones land.
                self.manifest.apply(self._disk.manifest.records(), ())
                recovering = len(self.manifest) > 0
            if self._rdma_device is not False:
                from kvpool.store_node.rdma import open_node_rdma
                self._rdma = open_node_rdma(self._rdma_device,
                                            required=self._rdma_device is not None)
            if self._rdma is not None:
                for sid, seg in self.segments.items():
                    # Not the disk tier: registering it would pin (read in) the whole file.
                    # HBM through a dma-buf where it can be (see hbm.py), else not at all.
                    if seg.info.tier in ("dram", "hbm"):
                        self._published[sid] = self._rdma.register(seg)
            # The committed objects' index: same-host peers read it without the master (shm),
            # and the data port checks a READ_HELD against it (tcp).
            dram = [seg for seg in self.segments.values() if seg.info.tier == "dram"]
            if dram:
                index = IndexWriter(buckets_for(sum(seg.info.size_bytes for seg in dram)))
                for seg in dram:
                    index.add_segment(seg.info.segment_id)
                self.manifest.index = index
            self._server = DataServer(self.segments, self._host, self._port, shm=self._shm,
                                      rdma=self._rdma, supervisor=self._supervisor,
                                      manifest=self.manifest, limits=self._data_limits,
                                      tls=self._data_tls)
            self._server.start()
            host, _, port = self._server.tcp_endpoint.rpartition(":")
            self.endpoints = NodeEndpoints(
                node_id=self.node_id, boot_id=local_boot_id(),
                tcp_endpoint=f"{self._advertise or host}:{port}",
                shm_endpoint=self._server.shm_endpoint, tcp_tls=self._data_tls is not None)
            if self._rdma is not None:
                self.endpoints = self._rdma.advertise(self.endpoints)
            deadline = time.monotonic() + mount_timeout_s
            while True:
                try:
                    if recovering:
                        self._recover()
                    else:
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
        run = self._supervisor.start_thread
        self._thread = run("heartbeat", self._heartbeat_loop, VITAL, self._stop)
        # A move lost in a crash is given up by the master after its put timeout; serving
        # goes on without it, so the mover is always restarted.
        self._mover = run("mover", self._move_loop, RESTART, self._stop)
        self._watcher = run("manifest", self._watch_loop, VITAL, self._stop)
        self._wait_stream_open()
        if self._scrubber is not None:
            self._scrubber.start()
        log.info("store_node_started", node=self.node_id, tcp=self.endpoints.tcp_endpoint,
                 shm=bool(self.endpoints.shm_endpoint),
                 rdma=self.endpoints.rdma_device or None, segments=len(self.segments),
                 capacity_bytes=sum(self._sizes))

    def _mount_all(self, recovering: bool = False) -> None:
        for sid in self.segments:
            epoch, key = self._master.mount_segment_keyed(
                self.endpoints, self._published[sid], keeps_manifest=True,
                recovering=recovering)
            # From now on writers are fenced by this master's epoch (store_node/manifest.py):
            # what the previous master's writers reserved or sealed before is announced below.
            self.manifest.set_epoch(epoch)
            # ... and tcp clients reach only the extents this master grants them.
            self._server.set_grant_key(key)

    def _heartbeat_loop(self) -> None:
        while True:
            self._wake.wait(self._interval_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            with self._moves_lock:
                done, self._moves_done = self._moves_done, []
                failed, self._moves_failed = self._moves_failed, []
            try:
                if self._announcing:
                    self._recover()
                committed, removed, moves = self._master.heartbeat_moves(self.node_id, done,
                                                                         failed)
                done = failed = []
                self._apply_manifest(committed, removed)
                self._recheck(self._master.take_rechecks())
                for m in moves:
                    self._moves.put(m)
            except UnknownNode:
                # The master declared us dead or restarted: mount again, keeping new objects
                # out of our segments until it has indexed the ones they already hold.
                log.warning("master_forgot_node_remounting", node=self.node_id,
                            objects=len(self.manifest))
                self._announcing = True   # until it is all done, even across failures
                self._abandon_moves()
                try:
                    self._recover()
                except KVPoolError as e:
                    log.warning("remount_failed", error=str(e))
            except KVPoolError as e:
                log.warning("heartbeat_failed", error=str(e))
            finally:
                if done or failed:   # not reported: again with the next heartbeat
                    with self._moves_lock:
                        self._moves_done += done
                        self._moves_failed += failed

    def _move_loop(self) -> None:
        """Make the moves the master asks for, one at a time, and report each."""
        while True:
            m = self._moves.get()
            try:
                if m is None:
                    return
                ok = self._copy(m)
                with self._moves_lock:
                    (self._moves_done if ok else self._moves_failed).append(m.move_id)
            finally:
                self._moves.task_done()
            if self._moves.empty():
                self._wake.set()   # report now: the master frees the source sooner

    def _abandon_moves(self) -> None:
        """Drop the moves not started and wait for the one being made: a master that forgot
        us forgot them too, and may hand their destinations to new objects once we have
        announced what we hold."""
        while True:
            try:
                self._moves.get_nowait()
            except queue.Empty:
                break
            self._moves.task_done()
        self._moves.join()
        with self._moves_lock:
            self._moves_done, self._moves_failed = [], []

    def _copy(self, m: Move) -> bool:
        src, dst = self.segments.get(m.src.segment_id), self.segments.get(m.dst.segment_id)
        if src is None or dst is None:
            log.warning("move_refused", key=m.key, src=m.src.segment_id, dst=m.dst.segment_id)
            return False
        self.manifest.overwriting(m.dst.segment_id, m.dst.offset, m.dst.length)
        try:
            # The disk or HBM side does the I/O, in one call: into it a pwrite or a device
            # copy from the DRAM mapping, out of it a preadv or a device copy into it.
            if src.host_addressable and dst.info.tier != "dram":
                dst.write_from(m.dst.offset, src.buffer[m.src.offset:m.src.end])
            else:
                src.read_into(m.src.offset, dst.buffer[m.dst.offset:m.dst.end])
        except (OSError, ValueError) as e:
            log.warning("move_failed", key=m.key, src=m.src.segment_id, dst=m.dst.segment_id,
                        error=str(e))
            return False
        return True

    def _apply_manifest(self, committed, removed, reserved=()) -> None:
        if self._rdma is not None:   # a committed object is never writable again
            committed = list(committed)
            self._rdma.committed(committed)
        self.manifest.apply(committed, removed, reserved)
        if self._disk is not None and self._disk.manifest is not None:
            self._disk.manifest.apply(committed, removed)

    def _watch_loop(self) -> None:
        """Apply the manifest changes the master pushes as it commits, and acknowledge them
        (the put path waits for that, so the manifest never misses an acknowledged put);
        while the stream is down, the master keeps them for when it is back."""
        while not self._stop.is_set():
            try:
                for seq, committed, removed, reserved in self._master.watch_manifest(
                        self.node_id, WATCH_DEADLINE_S):
                    self._apply_manifest(committed, removed, reserved)
                    if seq:
                        self._master.ack_manifest(self.node_id, seq)
                    self._stream_open.set()
            except KVPoolError as e:
                self._stream_open.clear()
                if self._stop.wait(self._interval_s):
                    return
                log.debug("manifest_watch_retrying", error=str(e))
            self._stream_open.clear()

    def _wait_stream_open(self) -> None:
        """Wait (a few heartbeats at most) for the manifest stream: until it is open, puts on
        this node's segments wait for it on the master (MAX_WAIT_S at most)."""
        if not self._stream_open.wait(3 * self._interval_s):
            log.warning("manifest_stream_not_open", node=self.node_id,
                        waited_s=3 * self._interval_s)

    def _report_corrupt(self, records) -> None:
        """Report replicas this node found damaged itself: the master drops them."""
        self._master.report_corrupt([r.key for r in records], [r.version for r in records],
                                    [r.segment_id for r in records], node_id=self.node_id)

    def _recheck(self, suspects) -> None:
        """Re-check what readers reported corrupt here; confirm only what really is. (On
        the heartbeat thread: a few objects per beat, each a checksum at ~20 GB/s.)"""
        if not suspects:
            return
        bad = recheck(self.manifest, self.segments, suspects)
        log.warning("corrupt_reports_rechecked", reported=len(suspects), confirmed=len(bad),
                    keys=[k for k, _, _ in suspects[:8]])
        if bad:
            self._report_corrupt(bad)
            self.manifest.forget_records(bad)

    def _recover(self) -> None:
        """Mount every segment as recovering, then re-announce the manifest in batches, the
        last one marked done; objects the master refuses (Conflict) are forgotten. Retried
        from the start if a call fails: mounting and announcing again are harmless."""
        self._mount_all(recovering=True)
        # New objects come here once the announcement is done: by then the stream must be open,
        # to this master (the one we watched may be alive but no longer lead: paused, fenced).
        self._stream_open.clear()
        self._master.end_watches()
        self._wait_stream_open()
        started = time.monotonic()
        batches = self.manifest.batches(ANNOUNCE_BATCH) or [[]]
        indexed = 0
        for n, batch in enumerate(batches, 1):
            done = n == len(batches)
            # With the last batch: space the previous master handed out or freed under a
            # lease, which the new one must not reuse until those writes and reads are over.
            results = self._master.announce_objects(
                self.node_id, batch, done=done,
                reserved=self.manifest.reservations() if done else ())
            refused = [r.key for r, err in zip(batch, results) if isinstance(err, Conflict)]
            self.manifest.forget(refused)
            # Sealed records the master indexed now need no other word from it.
            self.manifest.confirm([r for r, err in zip(batch, results) if err is None])
            if self._disk is not None and self._disk.manifest is not None:
                self._disk.manifest.forget(refused)
            indexed += sum(err is None for err in results)
        self._announcing = False
        log.info("objects_reannounced", node=self.node_id, indexed=indexed,
                 seconds=round(time.monotonic() - started, 3))

    def not_ready(self) -> str | None:
        """Why this node should not take traffic now (readiness probe), or None. Safe to call
        from any thread, also before ``start`` ends."""
        if self._stop.is_set():
            return "stopping"
        if self._thread is None:
            return "starting: not mounted on the master yet"
        if self._announcing:
            return "announcing what it holds to a restarted master"
        if not self._stream_open.is_set():
            return "its manifest stream to the master is not open"
        return None

    def figures(self) -> NodeFigures:
        """Counters and figures for the metrics; safe from any thread, also before ``start``."""
        server, scrub = self._server, self._scrubber
        return NodeFigures(
            server.request_counts() if server else {}, server.byte_counts() if server else {},
            server.connections() if server else {},
            scrub.objects_checked if scrub else 0, scrub.bytes_checked if scrub else 0,
            scrub.corrupt_found if scrub else 0, self.manifest.bytes_by_segment())

    @property
    def moves_queued(self) -> int:
        """Tier moves the master asked for and the mover has not made yet."""
        return self._moves.qsize()

    def stop(self, unmount: bool = True) -> None:
        """Unmount (best effort), stop serving, release memory. Idempotent."""
        self._stop.set()
        self._wake.set()
        if self._scrubber is not None:
            self._scrubber.stop()
        if self._thread:
            self._thread.join()
            self._thread = None
        if self._mover:
            self._moves.put(None)
            self._mover.join()
            self._mover = None
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
        if self._disk is not None:   # syncs the data and the manifest, unlocks the directory
            self._disk.close()
        for seg in self.segments.values():
            seg.close()
        self.segments.clear()
        self._master.close()   # ends the manifest stream
        if self._watcher:
            self._watcher.join(timeout=5.0)
            self._watcher = None
        self.manifest.close_index()   # no peer trusts an entry from here on
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
