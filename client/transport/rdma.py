"""The rdma transport: one-sided RDMA READ and WRITE into store nodes' registered segments.

The store node's CPU takes no part in moving the bytes: for each op the client asks the node,
with the master's grant, for a memory region over exactly the op's extent (RKEY_READ or
RKEY_WRITE on the handshake connection, a wave of ops in one round trip: store_node/rdma.py),
and the client's RC queue pair then reads or writes that memory directly. A segment's own
region (``Replica.rdma_rkey``) is registered for local access only: non-zero, it says the
segment is served over RDMA.

Connection setup: one RC queue pair per (client transport, node), created on first use through
the CONNECT_QP handshake on the node's tcp data port (:mod:`kvpool.net.data_port`), then reused.
The handshake connection stays open for the queue pair's life: the node tears its queue pair
down when it closes, and its EOF tells us at once that the node died (RC retries alone would
take seconds to notice).

Buffers: memory registered with :meth:`RDMATransport.register_buffer` (``KVClient.register_buffer``)
is read and written in place, with zero copies; other buffers go through a registered staging
area (one memcpy each way). Every op is split into work requests of at most the port's maximum
message size (8 MiB on soft-RoCE); up to ``max_outstanding`` are in flight at once.

Errors, per op: a descriptor the node's device refuses (wrong rkey, range outside the region)
is asked a new region for once, then is a SegmentBoundsError; so is one the client can refuse
before posting (segment not registered for RDMA, range outside ``rdma_length``). A queue pair
that breaks (remote refusal, retries exhausted) is re-created, and the ops it did not finish
run again on the new one; a second break in one call, a timeout, or the node's death fails the
node's remaining ops with TransportError, so the client moves on to another replica.
"""

from __future__ import annotations

import bisect
import mmap
import select
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from kvpool.client.buffers import byte_view
from kvpool.client.transport.base import IoOp, Transport, byte_views, group_by
from kvpool.common import capabilities
from kvpool.common.errors import ClientClosed, KVPoolError, SegmentBoundsError, TransportError
from kvpool.common.logging import get_logger
from kvpool.common.types import NodeEndpoints
from kvpool.net.data_port import (
    MAX_REGIONS_PER_CONNECTION,
    QP_INFO,
    RESPONSE,
    RKEY,
    UNGRANTED_REGION_S,
    FrameStatus,
    Op,
    decode_qp_info,
    encode_qp_info,
    encode_request,
    recv_refusal,
)
from kvpool.net.rdma_probe import unavailable_reason
from kvpool.net.sockets import recv_exact

log = get_logger(__name__)

MiB = 1 << 20
_U64 = 1 << 64
_STAGE_ALIGN = 64
_SPINS_BEFORE_SLEEP = 64
_POLL_SLEEP_S = 0.0002
_LIVENESS_EVERY_S = 0.02
# Ops whose regions are asked for at once (net/data_port.py MAX_REGIONS_PER_CONNECTION: 4096).
_REGION_WAVE = 1024
# A kept read region is used until this long before its grant expires (clocks differ a little).
_REGION_MARGIN_S = 5.0
# The handshake connection carries nothing between our own exchanges on it (RKEY_READ/WRITE,
# each answered before the ops run): readable or hung up = node gone.
_GONE = select.POLLIN | select.POLLHUP | select.POLLERR | select.POLLNVAL


class _ReadRegions:
    """The read regions a node registered for one link, kept for re-reads: a lookup that names
    an extent one of them covers exactly is read through it, without RKEY_READ's round trip
    and the node's registration (engines that share a prompt read its blocks again and
    again). Right whatever the extent holds by then: a region reaches the extent's bytes, not
    an object's, and the lookup has just said (and leased) that the key's bytes are there; the
    grant it came with allows that very range. Kept only while the node surely keeps it, by
    the node's own rules (store_node/rdma.py): until the grant's expiry (less
    ``_REGION_MARGIN_S``), and while fewer than ``MAX_REGIONS_PER_CONNECTION`` regions, write
    regions too, have been registered on the link after it (one more closes the oldest)."""

    def __init__(self) -> None:
        # (segment id, offset, length) -> (address, rkey, expiry in unix seconds, sequence)
        self._kept: OrderedDict[tuple[str, int, int], tuple[int, int, float, int]] = \
            OrderedDict()
        self.registered = 0   # regions the node registered for this link, in its order

    def get(self, segment_id: str, offset: int, length: int, asking: int,
            now_s: float) -> tuple[int, int] | None:
        """(address, rkey) of the region over exactly this extent, if the node still keeps it
        after registering ``asking`` more for this link; None otherwise."""
        key = (segment_id, offset, length)
        kept = self._kept.get(key)
        if kept is None:
            return None
        addr, rkey, expiry_s, sequence = kept
        if self.registered + asking - sequence > MAX_REGIONS_PER_CONNECTION \
                or expiry_s - now_s < _REGION_MARGIN_S:
            del self._kept[key]
            return None
        return addr, rkey

    def registered_one(self, segment_id: str, offset: int, length: int, addr: int, rkey: int,
                       expiry_s: float | None) -> None:
        """The node registered a region for this link (in the order it did); ``expiry_s``:
        a read region's expiry, kept; None: a write region, only counted."""
        sequence, self.registered = self.registered, self.registered + 1
        if expiry_s is None:
            return
        key = (segment_id, offset, length)
        self._kept[key] = (addr, rkey, expiry_s, sequence)
        self._kept.move_to_end(key)
        while len(self._kept) > MAX_REGIONS_PER_CONNECTION:
            self._kept.popitem(last=False)


def _region_expiry_s(grant: bytes, now_s: float) -> float:
    """When the node closes the read region it registers for ``grant`` (data_port.py)."""
    return capabilities.GRANT.unpack_from(grant)[1] / 1000 if grant \
        else now_s + UNGRANTED_REGION_S


class _Link:
    """The queue pair to one node, the tcp connection that set it up, and the read regions the
    node registered for it (they end with it)."""

    def __init__(self, endpoint: str, sock: socket.socket, qp, cq) -> None:
        self.endpoint = endpoint
        self.sock = sock
        self.qp = qp
        self.cq = cq
        self.read_regions = _ReadRegions()

    def alive(self) -> bool:
        poller = select.poll()
        poller.register(self.sock, _GONE)
        return not poller.poll(0)

    def close(self) -> None:
        for resource in (self.qp, self.cq):
            try:
                resource.close()
            except Exception as exc:  # noqa: BLE001 - a broken QP may refuse; nothing to do
                log.debug("rdma_close_failed", endpoint=self.endpoint, error=str(exc))
        self.sock.close()


@dataclass(slots=True)
class _Registration:
    addr: int
    length: int
    mr: object
    view: memoryview      # keeps the caller's memory alive (and a bytearray unresizable)


@dataclass(slots=True)
class _Piece:
    """One work request: ``length`` bytes of op ``op`` starting ``start`` bytes into it."""

    op: int
    start: int
    length: int
    remote_addr: int
    rkey: int
    local_addr: int = 0    # zero-copy: the caller's registered memory
    lkey: int = 0
    stage: int = -1        # staged: offset in the staging area (set per wave)
    kept: bool = False     # aimed at a region kept from an earlier read (_ReadRegions)


class _Outcome:
    """What running pieces on a link left to do."""

    def __init__(self) -> None:
        self.unfinished: list[_Piece] = []
        self.refused: dict[int, SegmentBoundsError] = {}
        self.broken = ""       # why the QP is unusable ("" = fine)
        self.fatal: TransportError | None = None   # give up on this node for this call


class RDMATransport(Transport):
    """Moves bytes with one-sided RDMA READ/WRITE over pyverbs RC queue pairs; thread-safe.

    ``device``: the RDMA device (default: the first one found); ``port``/``gid_index``: which
    port and GID (default: port 1, its RoCE v2 GID). ``timeout_s`` bounds the handshake and
    every wait for completions. ``staging_bytes``: the registered staging area for buffers not
    registered with :meth:`register_buffer`. ``max_outstanding``: work requests in flight.
    Raises TransportError where there is no RDMA (see :func:`unavailable_reason`).
    """

    scheme = "rdma"

    def __init__(self, timeout_s: float = 10.0, *, device: str | None = None, port: int = 1,
                 gid_index: int | None = None, staging_bytes: int = 32 * MiB,
                 max_outstanding: int = 32, connect_timeout_s: float | None = None) -> None:
        reason = unavailable_reason()
        if reason:
            raise TransportError(f"rdma transport unavailable: {reason}")
        from kvpool.net import verbs
        self._verbs = verbs
        self._timeout_s = timeout_s
        self._connect_timeout_s = timeout_s if connect_timeout_s is None else connect_timeout_s
        self._max_outstanding = max(1, max_outstanding)
        self._dev = verbs.Device(device, port=port, gid_index=gid_index)
        self._max_wr_bytes = min(self._dev.max_msg_bytes or 8 * MiB, 64 * MiB)
        staging_bytes = max(staging_bytes, self._max_wr_bytes)
        try:
            self._stage_mm = mmap.mmap(-1, staging_bytes)
            self._stage = memoryview(self._stage_mm)
            self._stage_mr = self._dev.register(verbs.buffer_address(self._stage), staging_bytes,
                                                verbs.LOCAL_ACCESS)
        except BaseException:
            self._dev.close()
            raise
        self._lock = threading.Lock()
        self._links: dict[str, _Link] = {}
        self._regs: list[_Registration] = []      # sorted by addr
        self._closed = False
        log.info("rdma_transport_opened", device=self._dev.name, gid=self._dev.gid,
                 staging_bytes=staging_bytes)

    @property
    def device(self) -> str:
        return self._dev.name

    def can_reach(self, node: NodeEndpoints) -> bool:
        # Not a node whose data port speaks TLS: the queue-pair handshake on it is not wrapped.
        return bool(node.rdma_gid) and bool(node.tcp_endpoint) and not node.tcp_tls

    def read(self, ops: Sequence[IoOp]) -> list[TransportError | None]:
        return self._run(ops, byte_views(ops, writable=True), write=False)

    def write(self, ops: Sequence[IoOp]) -> list[TransportError | None]:
        return self._run(ops, byte_views(ops, writable=False), write=True)

    # ---------------------------------------------------------------- registered buffers

    def register_buffer(self, buffer) -> None:
        """Register ``buffer`` (bytearray, numpy array, CPU tensor, writable memoryview) so
        that ops on it, or on any slice of it, move bytes in place. Pins its pages until
        :meth:`unregister_buffer` or :meth:`close`. Registering the same memory twice is a no-op."""
        view = byte_view(buffer, writable=True)
        if view.nbytes == 0:
            return
        addr = self._verbs.buffer_address(view)
        with self._lock:
            self._check_open()
            if any(r.addr == addr and r.length == view.nbytes for r in self._regs):
                return
            try:
                mr = self._dev.register(addr, view.nbytes, self._verbs.LOCAL_ACCESS)
            except Exception as exc:
                raise TransportError(f"registering {view.nbytes} bytes failed: {exc}") from exc
            reg = _Registration(addr, view.nbytes, mr, view)
            self._regs.insert(bisect.bisect([r.addr for r in self._regs], addr), reg)

    def unregister_buffer(self, buffer) -> None:
        """Undo :meth:`register_buffer` (a no-op for memory that is not registered)."""
        view = byte_view(buffer, writable=True)
        if view.nbytes == 0:
            return
        addr = self._verbs.buffer_address(view)
        with self._lock:
            for reg in [r for r in self._regs if r.addr == addr and r.length == view.nbytes]:
                self._regs.remove(reg)
                reg.mr.close()
                reg.view.release()

    def _registration(self, addr: int, length: int) -> _Registration | None:
        for reg in self._regs:   # a handful of large buffers: a scan is fine
            if reg.addr <= addr and addr + length <= reg.addr + reg.length:
                return reg
        return None

    # ---------------------------------------------------------------- lifecycle

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            links, self._links = self._links, {}
            regs, self._regs = self._regs, []
        for link in links.values():
            link.close()
        for reg in regs:
            reg.mr.close()
            reg.view.release()
        self._stage_mr.close()
        self._dev.close()
        self._stage.release()
        self._stage_mm.close()

    def _check_open(self) -> None:
        if self._closed:
            raise ClientClosed("transport is closed")

    # ---------------------------------------------------------------- batching

    def _run(self, ops: Sequence[IoOp], views: list[memoryview], *, write: bool
             ) -> list[TransportError | None]:
        results: list[TransportError | None] = [None] * len(ops)
        with self._lock:
            self._check_open()
            for endpoint, indexes in group_by(ops, lambda o: o.replica.node.tcp_endpoint).items():
                node = ops[indexes[0]].replica.node
                if not self.can_reach(node):
                    for i in indexes:
                        results[i] = TransportError(f"node {node.node_id!r} offers no rdma")
                    continue
                pieces: list[_Piece] = []
                for i in indexes:
                    refusal = _local_refusal(ops[i])
                    if refusal is not None:
                        results[i] = refusal
                    else:
                        pieces += self._split(i, ops[i], views[i])
                if pieces:
                    # Regions are asked for a wave of ops at a time (the node keeps a bounded
                    # number per connection, dropping the oldest).
                    wave_of = {i: k // _REGION_WAVE for k, i in enumerate(indexes)}
                    waves: dict[int, list[_Piece]] = {}
                    for piece in pieces:
                        waves.setdefault(wave_of[piece.op], []).append(piece)
                    for wave in waves.values():
                        self._run_node(endpoint, wave, ops, views, write, results)
        return results

    def _split(self, i: int, op: IoOp, view: memoryview) -> list[_Piece]:
        length = op.replica.extent.length
        if length == 0:
            return []
        base = self._verbs.buffer_address(view)
        reg = self._registration(base, length)
        pieces = []
        for start in range(0, length, self._max_wr_bytes):
            n = min(self._max_wr_bytes, length - start)
            piece = _Piece(i, start, n, 0, 0)   # aimed at its region by _grant_regions
            if reg is not None:
                piece.local_addr, piece.lkey = base + start, reg.mr.lkey
            pieces.append(piece)
        return pieces

    def _run_node(self, endpoint: str, pieces: list[_Piece], ops: Sequence[IoOp],
                  views: list[memoryview], write: bool, results: list) -> None:
        """Run one node's pieces, re-creating a broken queue pair once; fills ``results``."""
        rebuilds_left, asked_again = 1, False
        while pieces:
            try:
                link = self._link(endpoint)
                refused = self._grant_regions(link, pieces, ops, write)
            except TransportError as exc:
                _fail(pieces, results, exc)
                return
            for i, err in refused.items():
                results[i] = err
            pieces = [p for p in pieces if p.op not in refused]
            if not pieces:
                return
            outcome = self._execute(link, pieces, views, write)
            # Every region was granted over its op's extent, so a refusal means the node no
            # longer has it: kept past its life (a clock far from the node's, a segment
            # registered again), or the node is being killed (its regions go before its sockets
            # close). Asked for afresh once, on a new link (the refusal broke this one): a dead
            # node fails that (TransportError), a live one grants anew; a second refusal stands.
            again = set() if asked_again else set(outcome.refused)
            if again:
                asked_again = True
                log.info("rdma_region_refused", endpoint=endpoint, ops=len(again))
                if not outcome.broken:
                    self._drop(link, "a region was refused")
            for i, err in outcome.refused.items():
                if i not in again:
                    results[i] = err
            pieces = [p for p in outcome.unfinished
                      if p.op not in outcome.refused or p.op in again]
            if outcome.broken:
                self._drop(link, outcome.broken)
            if not pieces:
                return
            if outcome.fatal is not None:
                _fail(pieces, results, outcome.fatal)
                return
            if outcome.broken and not outcome.refused:
                # Broken by no fault of a descriptor: re-create once, then the node is out.
                if rebuilds_left == 0:
                    _fail(pieces, results, TransportError(
                        f"rdma {endpoint}: queue pair failed again ({outcome.broken}); "
                        "treating the node as unavailable"))
                    return
                rebuilds_left -= 1

    def _grant_regions(self, link: _Link, pieces: list[_Piece], ops: Sequence[IoOp],
                       write: bool) -> dict[int, KVPoolError]:
        """Ask the node for a region over each op's extent (RKEY_READ or RKEY_WRITE with the
        op's grant, all sent at once on the handshake connection) and aim ``pieces`` at them;
        returns the ops refused. TransportError (the link dropped) if the exchange failed."""
        wanted = list(dict.fromkeys(p.op for p in pieces))
        kind = Op.RKEY_WRITE if write else Op.RKEY_READ
        regions: dict[int, tuple[int, int]] = {}
        refused: dict[int, KVPoolError] = {}
        kept = link.read_regions
        now_s = time.time()
        if not write:   # regions kept from earlier reads, still registered once these are
            asking = len(wanted)
            for i in wanted:
                e = ops[i].replica.extent
                if (region := kept.get(e.segment_id, e.offset, e.length, asking,
                                       now_s)) is not None:
                    regions[i] = region
            wanted = [i for i in wanted if i not in regions]
        reused = set(regions)
        try:
            # A write grant goes without its record tag (RESERVE and SEAL's), as on tcp.
            if wanted:
                link.sock.sendall(b"".join(
                    encode_request(kind, e.segment_id, e.offset, e.length,
                                   capabilities.write_grant(ops[i].replica.grant))
                    for i in wanted for e in (ops[i].replica.extent,)))
            for i in wanted:
                status, length = RESPONSE.unpack(recv_exact(link.sock, RESPONSE.size))
                if status == FrameStatus.OK and length == RKEY.size:
                    regions[i] = addr, rkey = RKEY.unpack(recv_exact(link.sock, RKEY.size))
                    e = ops[i].replica.extent
                    kept.registered_one(e.segment_id, e.offset, e.length, addr, rkey, None
                                        if write else _region_expiry_s(ops[i].replica.grant,
                                                                       now_s))
                    continue
                if status == FrameStatus.OK:
                    raise TransportError(f"malformed {kind.name} reply: {length} bytes")
                extent = ops[i].replica.extent
                why = (f"rdma {link.endpoint}: no region for [{extent.offset}, {extent.end}) of "
                       f"segment {extent.segment_id!r}: {recv_refusal(link.sock, status, length)}")
                refused[i] = SegmentBoundsError(why) if status in (
                    FrameStatus.OUT_OF_BOUNDS, FrameStatus.UNKNOWN_SEGMENT) \
                    else TransportError(why)
        except (OSError, TransportError) as exc:   # out of step, or gone: the link is done
            self._drop(link, f"{kind.name} failed: {exc}")
            raise TransportError(f"rdma {link.endpoint}: {kind.name} failed: {exc}") from None
        for p in pieces:
            if p.op in regions:
                addr, rkey = regions[p.op]
                p.remote_addr, p.rkey, p.kept = addr + p.start, rkey, p.op in reused
        return refused

    def _execute(self, link: _Link, pieces: list[_Piece], views: list[memoryview],
                 write: bool) -> _Outcome:
        """Post ``pieces`` in waves bounded by ``max_outstanding`` and the staging area."""
        v = self._verbs
        out = _Outcome()
        opcode = v.RDMA_WRITE if write else v.RDMA_READ
        stage_size = len(self._stage)
        next_piece = 0
        while next_piece < len(pieces):
            wave: list[_Piece] = []
            staged = 0
            while next_piece < len(pieces) and len(wave) < self._max_outstanding:
                p = pieces[next_piece]
                if not p.lkey:
                    if wave and staged + p.length > stage_size:
                        break
                    p.stage = staged
                    staged += -(-p.length // _STAGE_ALIGN) * _STAGE_ALIGN
                wave.append(p)
                next_piece += 1
            stage_base = v.buffer_address(self._stage)
            posted = 0
            try:
                for k, p in enumerate(wave):
                    if p.lkey:
                        local, lkey = p.local_addr, p.lkey
                    else:
                        if write:
                            self._stage[p.stage:p.stage + p.length] = \
                                views[p.op][p.start:p.start + p.length]
                        local, lkey = stage_base + p.stage, self._stage_mr.lkey
                    v.post_rdma(link.qp, k, opcode, local, p.length, lkey, p.remote_addr, p.rkey)
                    posted += 1
            except Exception as exc:  # noqa: BLE001 - pyverbs raises its own error types
                out.broken = f"post failed: {exc}"
            statuses, fatal = self._wait(link, posted)
            if fatal is not None:
                out.broken, out.fatal = str(fatal), fatal
                out.unfinished = wave + pieces[next_piece:]
                return out
            failed = False
            for k, p in enumerate(wave):
                status = statuses[k] if k < posted else v.FLUSHED
                if status == v.SUCCESS:
                    if not write and not p.lkey:
                        views[p.op][p.start:p.start + p.length] = \
                            self._stage[p.stage:p.stage + p.length]
                    continue
                failed = True
                out.unfinished.append(p)
                if status in v.REMOTE_REFUSALS:
                    out.refused[p.op] = SegmentBoundsError(
                        f"rdma {link.endpoint}: the node's device refused "
                        f"[{p.remote_addr:#x}, +{p.length}) with rkey {p.rkey:#x} "
                        f"(wc status {status})")
                elif status != v.FLUSHED:
                    out.broken = out.broken or f"work completion status {status}"
            if failed or out.broken:
                out.broken = out.broken or "queue pair in error"
                out.unfinished += pieces[next_piece:]
                return out
        return out

    def _wait(self, link: _Link, n: int) -> tuple[dict[int, int], TransportError | None]:
        """Poll ``n`` completions: {wr_id: status}, or the reason to give up on the node."""
        statuses: dict[int, int] = {}
        deadline = time.monotonic() + self._timeout_s
        next_check = time.monotonic() + _LIVENESS_EVERY_S
        empty = 0
        while len(statuses) < n:
            got, wcs = link.cq.poll(num_entries=16)
            for wc in wcs[:got]:
                statuses[wc.wr_id] = wc.status
            if got:
                empty = 0
                continue
            empty += 1
            if empty > _SPINS_BEFORE_SLEEP:
                time.sleep(_POLL_SLEEP_S)
            now = time.monotonic()
            if now >= next_check:
                next_check = now + _LIVENESS_EVERY_S
                if not link.alive():
                    return statuses, TransportError(f"rdma {link.endpoint}: node hung up")
                if now > deadline:
                    return statuses, TransportError(
                        f"rdma {link.endpoint}: timed out after {self._timeout_s:g}s waiting "
                        f"for {n - len(statuses)} of {n} completions")
        return statuses, None

    # ---------------------------------------------------------------- queue pairs

    def _link(self, endpoint: str) -> _Link:
        link = self._links.get(endpoint)
        if link is not None:
            if link.alive():
                return link
            self._drop(link, "node hung up")
        link = self._connect(endpoint)
        self._links[endpoint] = link
        return link

    def _drop(self, link: _Link, reason: str) -> None:
        if self._links.get(link.endpoint) is link:
            del self._links[link.endpoint]
        log.info("rdma_queue_pair_dropped", endpoint=link.endpoint, reason=reason)
        link.close()

    def _connect(self, endpoint: str) -> _Link:
        """The CONNECT_QP handshake over the node's tcp data port."""
        host, sep, port = endpoint.rpartition(":")
        if not sep or not port.isdigit():
            raise TransportError(f"malformed tcp endpoint {endpoint!r}")
        qp = cq = sock = None
        try:
            sock = socket.create_connection((host.strip("[]"), int(port)),
                                            timeout=self._connect_timeout_s)
            sock.settimeout(self._timeout_s)
            qp, cq = self._dev.create_qp(self._max_outstanding)
            local = self._dev.local_info(qp)
            sock.sendall(encode_request(Op.CONNECT_QP, "", 0, QP_INFO.size)
                         + encode_qp_info(local.qp_num, local.psn, local.gid, local.mtu))
            status, length = RESPONSE.unpack(recv_exact(sock, RESPONSE.size))
            if status != FrameStatus.OK:
                raise TransportError("node refused the queue pair: "
                                     + recv_refusal(sock, status, length))
            if length != QP_INFO.size:
                raise TransportError(f"malformed reply: {length}-byte QP info")
            try:
                remote = self._verbs.QPInfo(*decode_qp_info(recv_exact(sock, length)))
            except ValueError as exc:
                raise TransportError(f"malformed reply: {exc}") from None
            self._dev.connect(qp, local, remote)
        except Exception as exc:
            for resource in (qp, cq, sock):
                if resource is not None:
                    resource.close()
            if isinstance(exc, KVPoolError):
                raise TransportError(f"rdma {endpoint}: {exc}") from None
            if isinstance(exc, TimeoutError):
                raise TransportError(f"rdma {endpoint}: handshake timed out") from None
            if isinstance(exc, OSError):
                raise TransportError(f"rdma {endpoint}: {exc.strerror or exc}") from None
            raise TransportError(f"rdma {endpoint}: queue pair setup failed: {exc}") from exc
        log.debug("rdma_queue_pair_connected", endpoint=endpoint, qp_num=local.qp_num,
                  remote_qp_num=remote.qp_num)
        return _Link(endpoint, sock, qp, cq)


def _local_refusal(op: IoOp) -> SegmentBoundsError | None:
    """Descriptors that address nothing RDMA can reach: refused without posting."""
    replica, extent = op.replica, op.replica.extent
    if not replica.rdma_rkey:
        return SegmentBoundsError(f"segment {extent.segment_id!r} is not registered for rdma "
                                  f"on node {replica.node.node_id!r}")
    if (extent.offset < 0 or extent.length < 0 or extent.end > replica.rdma_length
            or replica.rdma_addr + extent.end >= _U64):
        return SegmentBoundsError(f"[{extent.offset}, {extent.end}) is outside segment "
                                  f"{extent.segment_id!r} of {replica.rdma_length} bytes")
    return None


def _fail(pieces: list[_Piece], results: list, error: TransportError) -> None:
    for p in pieces:
        if results[p.op] is None:
            results[p.op] = TransportError(str(error))
