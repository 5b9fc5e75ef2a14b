"""An in-process store node mounting one DRAM segment, and a KVClient that owns one."""

from __future__ import annotations

from collections.abc import Sequence

from kvpool.client.kv_client import KVClient
from kvpool.client.transport.base import Transport
from kvpool.common.errors import InvalidArgument
from kvpool.common.logging import get_logger
from kvpool.common.loops import LoopCrashed, Supervisor
from kvpool.store_node.node import StoreNode

log = get_logger(__name__)
# An embedded node heartbeats as a store node process does by default.
_HEARTBEAT_S = 1.0


class EmbeddedSegment:
    """A store node run by threads of the calling process, serving one DRAM segment of
    ``size_bytes`` (shm for readers on this host, tcp for the others). Its objects live in
    this process: they are lost when it stops or dies, as in Mooncake, and the master drops
    them from its index when the segment is unmounted or the node expires."""

    def __init__(self, master: str, size_bytes: int, *, host: str = "127.0.0.1",
                 advertise_host: str | None = None,
                 heartbeat_interval_s: float = _HEARTBEAT_S):
        if size_bytes <= 0:
            raise InvalidArgument(f"a segment needs a size > 0, not {size_bytes}")
        self.crashed: LoopCrashed | None = None
        # A crashed loop must not end the host process (a store node's own supervisor
        # exits): the segment just stops being served, and the master expires it.
        self._node = StoreNode(master, [size_bytes], host=host, advertise_host=advertise_host,
                               heartbeat_interval_s=heartbeat_interval_s, rdma_device=False,
                               supervisor=Supervisor(fatal=self._crashed))
        self.size_bytes = size_bytes

    def _crashed(self, error: LoopCrashed) -> None:
        self.crashed = error
        log.critical("embedded_segment_lost", reason=str(error))

    def start(self, mount_timeout_s: float = 30.0) -> None:
        """Allocate, serve and mount the segment; returns once the master has it."""
        self._node.start(mount_timeout_s)

    @property
    def node_id(self) -> str:
        return self._node.node_id

    @property
    def tcp_endpoint(self) -> str:
        """``host:port`` of the node's tcp data server (once started)."""
        return self._node.endpoints.tcp_endpoint if self._node.endpoints else ""

    def stop(self) -> None:
        """Unmount the segment, stop serving, free the memory. Idempotent."""
        self._node.stop(unmount=True)


class ContributingClient(KVClient):
    """A KVClient that also contributes ``host_bytes`` of this process's memory to the cluster
    (an :class:`EmbeddedSegment`) for as long as it is open; ``close`` unmounts it. The
    segment is mounted before the constructor returns."""

    def __init__(self, master: str, *, host_bytes: int, host: str = "127.0.0.1",
                 advertise_host: str | None = None, replicas: int = 0,
                 transports: Sequence[str | Transport] | None = None, timeout_s: float = 10.0,
                 **kw):
        """``host``/``advertise_host``: where the segment's tcp server listens and the address
        other hosts dial (see StoreNode). The rest as for KVClient."""
        self.segment = EmbeddedSegment(master, host_bytes, host=host,
                                       advertise_host=advertise_host)
        self.segment.start()
        try:
            super().__init__(master, replicas=replicas, transports=transports,
                             timeout_s=timeout_s, **kw)
        except BaseException:
            self.segment.stop()
            raise

    def close(self) -> None:
        """Close the client, then unmount and free the segment (its objects go with it)."""
        try:
            super().close()
        finally:
            self.segment.stop()
