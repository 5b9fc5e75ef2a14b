"""A store node's RDMA side: its segments registered as memory regions, the regions it grants
over single extents, and the responder queue pairs clients set up through the CONNECT_QP
handshake on the data port.

A segment is registered for local access only: its rkey reaches nothing from the wire. A client
asks for an extent's region with the master's grant (net/data_port.py RKEY_READ, RKEY_WRITE;
the data server checks the grant) and gets one registered over exactly that extent, remote
reads or remote writes only; so a client never holds an rkey that reaches bytes it was not
granted (rxe enforces a region's bounds; a type-2 memory window's it ignores). A region lives
until its grant expires; a write region until its extent's commit reaches the node, too (a
committed object is never writable again); none outlives the connection that asked for it,
and a connection holding ``MAX_REGIONS_PER_CONNECTION`` loses its oldest to the next (a client
asks for at most a wave's worth at a time, then uses them at once). Moving the bytes stays
one-sided: the node's CPU registers a region (one round trip with the request), not copies.
pyverbs is imported only by :func:`open_node_rdma`, so a node without RDMA never needs it.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections import OrderedDict

from kvpool.common.errors import InvalidArgument, KVPoolError
from kvpool.common.logging import get_logger
from kvpool.common.types import NodeEndpoints, ObjectRecord, SegmentInfo
from kvpool.net.data_port import MAX_REGIONS_PER_CONNECTION, UNGRANTED_REGION_S
from kvpool.store_node.memory import Segment

log = get_logger(__name__)

# A responder QP receives no work requests of its own: its send queue and CQ stay tiny.
_RESPONDER_DEPTH = 4


class RegionRefused(KVPoolError):
    """A region this node cannot grant (the data server answers UNSUPPORTED)."""


@dataclasses.dataclass(slots=True, eq=False)
class _Region:
    owner: object            # the connection that asked for it
    segment_id: str
    offset: int
    write: bool
    expiry_ms: float
    mr: object


class NodeRDMA:
    """An opened device with one memory region per registered segment. Thread-safe."""

    def __init__(self, device, verbs) -> None:
        self._dev = device
        self._verbs = verbs
        self._lock = threading.Lock()
        self._mrs: dict[str, object] = {}
        self._bases: dict[str, int] = {}   # a host-memory segment's address
        self._dmabufs: dict[str, int] = {}  # a device-memory segment's dma-buf fd
        # Granted regions, by connection, oldest first; write regions by extent too.
        self._regions: dict[object, OrderedDict[_Region, None]] = {}
        self._writes: dict[tuple[str, int], list[_Region]] = {}
        self._closed = False

    @property
    def device(self) -> str:
        return self._dev.name

    @property
    def gid(self) -> str:
        return self._dev.gid

    @property
    def port(self) -> int:
        return self._dev.port

    def advertise(self, endpoints: NodeEndpoints) -> NodeEndpoints:
        """``endpoints`` with this node's RDMA device, GID and port filled in."""
        return dataclasses.replace(endpoints, rdma_device=self.device, rdma_gid=self.gid,
                                   rdma_port=self.port)

    def register(self, segment: Segment) -> SegmentInfo:
        """Register ``segment`` for local access (its pages pinned; remote access goes through
        :meth:`region`); return its info with its address and a non-zero ``rdma_rkey`` that
        says it is served over RDMA (:func:`_flag`), to mount on the master. Device memory
        goes through :meth:`_register_dmabuf`."""
        if not segment.host_addressable:
            return self._register_dmabuf(segment)
        view = segment.buffer
        addr = self._verbs.buffer_address(view)
        with self._lock:
            if self._closed:
                raise KVPoolError("node RDMA is closed")
            mr = self._dev.register(addr, view.nbytes, self._verbs.LOCAL_ACCESS)
            self._mrs[segment.info.segment_id] = mr
            self._bases[segment.info.segment_id] = addr
        log.info("segment_registered_for_rdma", segment=segment.info.segment_id,
                 size_bytes=view.nbytes)
        return dataclasses.replace(segment.info, rdma_addr=addr, rdma_rkey=_flag(mr))

    def _register_dmabuf(self, segment: Segment) -> SegmentInfo:
        """Device memory (HBM) as a dma-buf region: its addresses start at 0 (see
        verbs.Device.register_dmabuf); its dma-buf stays open for the regions granted in it
        (dma-buf regions from an offset: run only where a GPU and an RDMA NIC meet). Where the segment cannot be exported or the device
        refuses the dma-buf, the segment stays unregistered (its info returned as is): it is
        then served over tcp through the node's pinned staging buffer, and the log says why."""
        from kvpool.store_node.hbm import DmaBufUnavailable
        info = segment.info
        try:
            export = getattr(segment, "export_dmabuf", None)
            if export is None:
                raise DmaBufUnavailable(f"a {info.tier} segment has no dma-buf")
            fd = export()
            try:
                with self._lock:
                    if self._closed:
                        raise KVPoolError("node RDMA is closed")
                    mr = self._dev.register_dmabuf(fd, info.size_bytes, self._verbs.LOCAL_ACCESS)
                    self._mrs[info.segment_id] = mr
                    # Kept open: each granted region is a dma-buf region of its own.
                    self._dmabufs[info.segment_id], fd = fd, -1
            finally:
                if fd >= 0:
                    os.close(fd)
        except (DmaBufUnavailable, self._verbs.PyverbsError) as exc:
            log.warning("segment_not_registered_for_rdma", segment=info.segment_id,
                        tier=info.tier, reason=str(exc),
                        served_by="tcp through pinned host staging")
            return info
        log.info("segment_registered_for_rdma", segment=info.segment_id, tier=info.tier,
                 size_bytes=info.size_bytes, via="dma-buf")
        return dataclasses.replace(info, rdma_addr=0, rdma_rkey=_flag(mr))

    def deregister(self, segment_id: str) -> None:
        """Deregister a segment, and every region granted in it, before its memory is
        released. A no-op if not registered."""
        with self._lock:
            mr = self._mrs.pop(segment_id, None)
            self._bases.pop(segment_id, None)
            fd = self._dmabufs.pop(segment_id, -1)
            gone = [r for regions in self._regions.values() for r in regions
                    if r.segment_id == segment_id]
            self._forget(gone)
        _close(gone)
        if mr is not None:
            mr.close()
        if fd >= 0:
            os.close(fd)

    # ---------------------------------------------------------------- granted regions

    def region(self, owner: object, segment_id: str, offset: int, length: int, write: bool,
               expiry_ms: float | None) -> tuple[int, int]:
        """Register ``[offset, offset + length)`` of a segment for remote reads (or,
        ``write``, remote writes) only, until ``expiry_ms`` (unix ms; None: a region asked
        for without a grant) or ``owner``'s end (:meth:`release`); returns its remote address
        and rkey. The caller checked the grant and the bounds. RegionRefused for a segment
        not registered here."""
        if expiry_ms is None:
            expiry_ms = (time.time() + UNGRANTED_REGION_S) * 1000
        access = self._verbs.REMOTE_WRITE_ONLY if write else self._verbs.REMOTE_READ_ONLY
        with self._lock:
            base = self._bases.get(segment_id)
            if base is not None:
                mr = self._dev.register(base + offset, length, access)
            elif (fd := self._dmabufs.get(segment_id)) is not None:
                # Device memory: addressed from 0 (register_dmabuf), so the region at offset.
                mr = self._dev.register_dmabuf(fd, length, access, offset=offset)
                base = 0
            else:
                raise RegionRefused(f"segment {segment_id!r} is not registered for rdma here")
            r = _Region(owner, segment_id, offset, write, expiry_ms, mr)
            regions = self._regions.setdefault(owner, OrderedDict())
            regions[r] = None
            if write:
                self._writes.setdefault((segment_id, offset), []).append(r)
            oldest = []
            while len(regions) > MAX_REGIONS_PER_CONNECTION:
                oldest.append(next(iter(regions)))
                self._forget(oldest[-1:])
        _close(oldest)
        return base + offset, mr.rkey

    def release(self, owner: object) -> None:
        """Close every region ``owner`` asked for (its connection ended)."""
        with self._lock:
            gone = list(self._regions.get(owner, ()))
            self._forget(gone)
        _close(gone)

    def expire(self, now_ms: float | None = None) -> None:
        """Close the regions whose grants expired."""
        now_ms = time.time() * 1000 if now_ms is None else now_ms
        with self._lock:
            gone = [r for regions in self._regions.values() for r in regions
                    if r.expiry_ms <= now_ms]
            self._forget(gone)
        _close(gone)

    def committed(self, records: list[ObjectRecord]) -> None:
        """The master committed these objects: close the write regions over them."""
        if not self._writes:
            return
        with self._lock:
            gone = [r for rec in records
                    for r in self._writes.get((rec.segment_id, rec.offset), ())]
            self._forget(gone)
        _close(gone)

    def regions(self) -> int:
        """Regions granted and not yet closed."""
        with self._lock:
            return sum(len(r) for r in self._regions.values())

    def _forget(self, gone: list[_Region]) -> None:
        for r in gone:
            regions = self._regions.get(r.owner)
            if regions is not None:
                regions.pop(r, None)
                if not regions:
                    del self._regions[r.owner]
            if r.write:
                extent = (r.segment_id, r.offset)
                same = self._writes.get(extent, [])
                if r in same:
                    same.remove(r)
                    if not same:
                        del self._writes[extent]

    def accept(self, client_info: bytes) -> tuple[bytes, object]:
        """Serve one CONNECT_QP: an RC queue pair connected to the client's, ready to be read
        and written. Returns our QP_INFO payload and a handle whose ``close()`` destroys the
        queue pair (the data server calls it when the handshake connection ends).
        ValueError for a malformed payload."""
        from kvpool.net.data_port import decode_qp_info, encode_qp_info
        remote = self._verbs.QPInfo(*decode_qp_info(client_info))
        qp, cq = self._dev.create_qp(_RESPONDER_DEPTH)
        try:
            local = self._dev.local_info(qp)
            self._dev.connect(qp, local, remote)
        except BaseException:
            qp.close()
            cq.close()
            raise
        return (encode_qp_info(local.qp_num, local.psn, local.gid, local.mtu),
                _ResponderQP(qp, cq))

    def close(self) -> None:
        """Deregister everything and close the device. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            mrs, self._mrs = self._mrs, {}
            fds, self._dmabufs = list(self._dmabufs.values()), {}
            gone = [r for regions in self._regions.values() for r in regions]
            self._regions.clear()
            self._writes.clear()
        _close(gone)
        for mr in mrs.values():
            mr.close()
        for fd in fds:
            os.close(fd)
        self._dev.close()


def _flag(mr) -> int:
    """A segment's ``rdma_rkey``: non-zero where it is registered, and no key to anything. A
    region without remote access has no rkey (rxe gives it 0), so this is its lkey, which
    reaches nothing from the wire either: a device serves remote access only to regions
    registered for it (rxe checks the region's rkey, 0 here; a real HCA its access flags)."""
    return mr.lkey


def _close(regions: list[_Region]) -> None:
    for r in regions:
        try:
            r.mr.close()
        except Exception as exc:  # noqa: BLE001 - pyverbs errors: the region is gone anyway
            log.debug("region_close_failed", segment=r.segment_id, error=str(exc))


class _ResponderQP:
    def __init__(self, qp, cq) -> None:
        self._qp, self._cq = qp, cq

    def close(self) -> None:
        for resource in (self._qp, self._cq):
            try:
                resource.close()
            except Exception as exc:  # noqa: BLE001 - closing a QP the device already reset
                log.debug("responder_qp_close_failed", error=str(exc))


def open_node_rdma(device: str | None = None, *, required: bool = False) -> NodeRDMA | None:
    """Open ``device`` (default: the first one found) for a store node.

    Without RDMA here (no pyverbs, no device), return None and say so once in the log; unless
    ``required`` (the operator named a device), then raise InvalidArgument with the reason.
    """
    from kvpool.net.rdma_probe import unavailable_reason
    reason = unavailable_reason()
    if reason:
        if required:
            raise InvalidArgument(f"--rdma-device {device}: {reason}")
        log.info("rdma_disabled", reason=reason)
        return None
    from kvpool.net import verbs
    dev = verbs.Device(device)
    log.info("rdma_enabled", device=dev.name, gid=dev.gid, port=dev.port, mtu_enum=dev.mtu)
    return NodeRDMA(dev, verbs)
