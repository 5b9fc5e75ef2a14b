"""A store node's RDMA side: its segments registered as memory regions, and the responder
queue pairs clients set up through the CONNECT_QP handshake on the data port.

The node is passive on this path: once a client's queue pair is connected, the client reads
and writes the registered segments without this process doing anything (it could be stopped).
pyverbs is imported only by :func:`open_node_rdma`, so a node without RDMA never needs it.
"""

from __future__ import annotations

import dataclasses
import os
import threading

from kvpool.common.errors import InvalidArgument, KVPoolError
from kvpool.common.logging import get_logger
from kvpool.common.types import NodeEndpoints, SegmentInfo
from kvpool.store_node.memory import Segment

log = get_logger(__name__)

# A responder QP receives no work requests of its own: its send queue and CQ stay tiny.
_RESPONDER_DEPTH = 4


class NodeRDMA:
    """An opened device with one memory region per registered segment. Thread-safe."""

    def __init__(self, device, verbs) -> None:
        self._dev = device
        self._verbs = verbs
        self._lock = threading.Lock()
        self._mrs: dict[str, object] = {}
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
        """Register ``segment`` (local write, remote read, remote write); return its info with
        the region's address and rkey, to mount on the master. Device memory goes through
        :meth:`_register_dmabuf`."""
        if not segment.host_addressable:
            return self._register_dmabuf(segment)
        view = segment.buffer
        addr = self._verbs.buffer_address(view)
        with self._lock:
            if self._closed:
                raise KVPoolError("node RDMA is closed")
            mr = self._dev.register(addr, view.nbytes, self._verbs.REMOTE_ACCESS)
            self._mrs[segment.info.segment_id] = mr
        log.info("segment_registered_for_rdma", segment=segment.info.segment_id,
                 size_bytes=view.nbytes, rkey=mr.rkey)
        return dataclasses.replace(segment.info, rdma_addr=addr, rdma_rkey=mr.rkey)

    def _register_dmabuf(self, segment: Segment) -> SegmentInfo:
        """Device memory (HBM) as a dma-buf region: its addresses start at 0 (see
        verbs.Device.register_dmabuf). Where the segment cannot be exported or the device
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
                    mr = self._dev.register_dmabuf(fd, info.size_bytes, self._verbs.REMOTE_ACCESS)
                    self._mrs[info.segment_id] = mr
            finally:
                os.close(fd)   # the region holds its own reference to the dma-buf
        except (DmaBufUnavailable, self._verbs.PyverbsError) as exc:
            log.warning("segment_not_registered_for_rdma", segment=info.segment_id,
                        tier=info.tier, reason=str(exc),
                        served_by="tcp through pinned host staging")
            return info
        log.info("segment_registered_for_rdma", segment=info.segment_id, tier=info.tier,
                 size_bytes=info.size_bytes, rkey=mr.rkey, via="dma-buf")
        return dataclasses.replace(info, rdma_addr=0, rdma_rkey=mr.rkey)

    def deregister(self, segment_id: str) -> None:
        """Deregister a segment before its memory is released. A no-op if not registered."""
        with self._lock:
            mr = self._mrs.pop(segment_id, None)
        if mr is not None:
            mr.close()

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
        for mr in mrs.values():
            mr.close()
        self._dev.close()


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
