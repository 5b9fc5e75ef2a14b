"""The client side of the master's gRPC API: deadlines, jittered retry, status -> exception.

Object calls return one result per key: a value, or the KVPoolError instance for that key
(the caller decides whether to raise it). Only transport-level failures raise here.
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import grpc
import numpy as np
from kvpool.common import capabilities, checksum
from kvpool.common.errors import (
    ClientClosed,
    KVPoolError,
    MasterUnavailable,
    NoSpace,
    QuotaExceeded,
    TransportError,
    UnknownNode,
    error_for_status,
)
from kvpool.common.types import (
    Move,
    NodeEndpoints,
    ObjectRecord,
    Replica,
    Reservation,
    SegmentInfo,
)
from kvpool.net import lookup_port
from kvpool.protos.kvpool.v1 import master_pb2 as pb
from kvpool.protos.kvpool.v1 import master_pb2_grpc
from kvpool.rpc import wire
from kvpool.rpc.grpc_client import GrpcClient, map_rpc_error, map_status
from kvpool.rpc.located import Located
from kvpool.rpc.lookup import LookupLost, Lookups


@dataclass(frozen=True, slots=True)
class PutGrant:
    """What a PutStart grants besides the places: the master's epoch, each key's version
    (parallel to the keys; 0 for a key refused) and how long a node holds a writer's
    reservation (``hold_s``). Empty (epoch 0) from a master that grants none. ``tenant``: the
    namespace the keys were put in (common/tenants.py), which a writer's records name."""

    epoch: int
    versions: list[int]
    hold_s: float
    tenant: str = ""
    # Asked for (``held``): each key's READ_HELD grant over its first replica's extent
    # (common/capabilities.py), parallel to the keys; b"" where none was minted.
    held: list[bytes] = field(default_factory=list)


class MasterClient(GrpcClient):
    """A blocking, thread-safe client of one master."""

    def __init__(self, address: str, timeout_s: float = 10.0, retries: int = 3, **security):
        """``security``: ``credentials``, ``role``, ``identity`` (rpc/grpc_client.py)."""
        super().__init__(address, master_pb2_grpc.MasterStub, timeout_s=timeout_s,
                         retries=retries, name="master client", **security)
        self._watches: set = set()   # the WatchManifest calls open now (end_watches)
        self._port_watches: dict = {}   # node id -> its stream's connection (rpc/lookup.py)
        self._watch_generation = 0   # end_watches calls so far
        self._lookups = Lookups(timeout_s, map_status, sessions=self.lookup_sessions)
        self._rechecks: list[tuple[str, int, str]] = []   # asked by heartbeat answers

    # -- membership (store nodes) --
    def mount_segment(self, node: NodeEndpoints, segment: SegmentInfo, *,
                      keeps_manifest: bool = False, recovering: bool = False) -> int:
        """Mount ``segment``; returns the master's epoch (a writer's grant carries it, and the
        node refuses a reservation or seal of another epoch)."""
        return self.mount_segment_keyed(node, segment, keeps_manifest=keeps_manifest,
                                        recovering=recovering)[0]

    def mount_segment_keyed(self, node: NodeEndpoints, segment: SegmentInfo, *,
                            keeps_manifest: bool = False, recovering: bool = False
                            ) -> tuple[int, bytes]:
        """:meth:`mount_segment`, also returning the key the master signs this node's data
        grants with (common/capabilities.py; empty: it mints none)."""
        r = self._call("MountSegment", pb.MountSegmentRequest(
            node=wire.node_to_pb(node), segment=wire.segment_to_pb(segment),
            keeps_manifest=keeps_manifest, recovering=recovering))
        return r.epoch, r.data_key

    def unmount_segment(self, node_id: str, segment_id: str) -> None:
        r = self._call("UnmountSegment", pb.UnmountSegmentRequest(node_id=node_id,
                                                                  segment_id=segment_id))
        if err := error_for_status(r.status, segment_id):
            raise err

    def heartbeat(self, node_id: str
                  ) -> tuple[list[ObjectRecord], list[tuple[str, int]]]:
        """Keep the node alive; returns what the master committed in and dropped from its
        segments since the last heartbeat (empty unless it mounted with keeps_manifest)."""
        committed, removed, _ = self.heartbeat_moves(node_id)
        return committed, removed

    def heartbeat_moves(self, node_id: str, done: Sequence[int] = (),
                        failed: Sequence[int] = ()
                        ) -> tuple[list[ObjectRecord], list[tuple[str, int]], list[Move]]:
        """``heartbeat`` for a node that makes moves between its tiers: reports the moves it
        finished (``done``) or gave up (``failed``) and returns the new ones as well."""
        r = self._call("Heartbeat", pb.HeartbeatRequest(node_id=node_id, moves_done=done,
                                                        moves_failed=failed))
        if r.status == pb.STATUS_UNKNOWN_NODE:
            raise UnknownNode(f"master does not know node {node_id!r}")
        if r.verify_keys:
            with self._lock:
                self._rechecks.extend(zip(r.verify_keys, r.verify_versions,
                                          r.verify_segment_ids))
        return (wire.records_from_pb(r.committed),
                list(zip(r.removed_keys, r.removed_versions)),
                [wire.move_from_pb(m) for m in r.moves])

    def watch_manifest(self, node_id: str, deadline_s: float
                       ) -> Iterator[tuple[int, list[ObjectRecord], list[tuple[str, int]],
                                           list[Reservation]]]:
        """The changes to a node's manifest as the master makes them, until ``deadline_s``
        passes (then the iterator ends: watch again) or the master goes away (raises): each
        with its seq, to :meth:`ack_manifest` once applied when it is not 0, and with the
        reservations it made (``until`` on this process's monotonic clock). On the master's
        lookup port where it has one we reach (a put waits for the node's acknowledgement:
        there it costs a wake-up each way), else over gRPC."""
        generation = self._watch_generation
        address = self._live_stub()[0]
        channel = self._lookup_channel()
        if channel is not None:
            try:
                conn = channel.open_stream(lookup_port.WATCH_MANIFEST,
                                           pb.WatchManifestRequest(node_id=node_id))
            except LookupLost:
                self._lookups.lost(channel)
            else:
                yield from self._watch_port(node_id, address, channel, conn, deadline_s,
                                            generation)
                return
        yield from self._watch_grpc(node_id, deadline_s)

    def _watch_port(self, node_id: str, address: str, channel, conn, deadline_s: float,
                    generation: int):
        end = time.monotonic() + deadline_s
        self._port_watches[node_id] = conn
        try:
            if self._watch_generation != generation or self.address != address:
                return   # ended (end_watches) or left for another master while it opened
            while (left := end - time.monotonic()) > 0:
                conn.sock.settimeout(left)
                try:
                    msg = channel.read_stream_frame(conn, pb.ManifestChanges)
                except TimeoutError:
                    return
                except LookupLost as e:
                    if self._closed:
                        raise ClientClosed(f"the {self._name} was closed during the call") \
                            from None
                    if self._port_watches.get(node_id) is not conn:   # end_watches: on purpose
                        raise MasterUnavailable(f"master {address}: manifest stream ended") \
                            from None
                    self._lookups.lost(channel)
                    if self.address == address:
                        self._fail_over(address, None)   # a standby or a dead master
                    raise MasterUnavailable(f"master {address}: manifest stream: {e}") from None
                if self.address != address:
                    return    # we follow another master now: this one no longer leads
                yield (msg.seq, wire.records_from_pb(msg.committed),
                       list(zip(msg.removed_keys, msg.removed_versions)),
                       wire.reservations_from_pb(msg.reserved, time.monotonic()))
        finally:
            if self._port_watches.get(node_id) is conn:
                del self._port_watches[node_id]
            conn.close()

    def _watch_grpc(self, node_id: str, deadline_s: float):
        address, stub = self._live_stub()
        stream = stub.WatchManifest(pb.WatchManifestRequest(node_id=node_id), timeout=deadline_s)
        self._watches.add(stream)
        try:
            for msg in stream:
                if self.address != address:
                    return    # we follow another master now: this one no longer leads
                yield (msg.seq, wire.records_from_pb(msg.committed),
                       list(zip(msg.removed_keys, msg.removed_versions)),
                       wire.reservations_from_pb(msg.reserved, time.monotonic()))
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                return
            if e.code() == grpc.StatusCode.CANCELLED and self._closed:
                raise ClientClosed(f"the {self._name} was closed during the call") from None
            if e.code() == grpc.StatusCode.UNAVAILABLE:
                self._fail_over(address, e)     # a standby or a dead master: find the leader
            raise map_rpc_error(e, f"master {address}: WatchManifest") from None
        finally:
            self._watches.discard(stream)
            stream.cancel()

    def end_watches(self) -> None:
        """End the open WatchManifest streams (their iterators raise): a node that mounted
        again, on a new or another master, watches that one, not one that went quiet."""
        for stream in list(self._watches):
            stream.cancel()
        self._watch_generation += 1   # a port stream still opening ends as soon as it is
        ended, self._port_watches = self._port_watches, {}
        for conn in ended.values():
            with contextlib.suppress(OSError):
                conn.sock.shutdown(socket.SHUT_RDWR)

    def ack_manifest(self, node_id: str, seq: int) -> None:
        """Tell the master that the node has applied its stream's changes up to ``seq`` (on
        the stream itself when it came by the lookup port). Not retried: a failure ends the
        stream, and the master sends what is unacknowledged again on the next one."""
        request = pb.AckManifestRequest(node_id=node_id, seq=seq)
        if (conn := self._port_watches.get(node_id)) is not None:
            try:
                conn.send(lookup_port.ACK_MANIFEST, request.SerializeToString())
            except OSError as e:
                raise MasterUnavailable(f"master {self.address}: AckManifest: {e}") from None
            return
        self._call("AckManifest", request, retry=False)

    def announce_objects(self, node_id: str, records: Sequence[ObjectRecord], done: bool,
                         reserved: Sequence[Reservation] = ()) -> list[KVPoolError | None]:
        """Re-announce objects a node holds to a master that forgot them (Conflict: drop it),
        and with ``done`` the reservations still running (``until`` on this process's
        monotonic clock)."""
        r = self._call("AnnounceObjects", pb.AnnounceObjectsRequest(
            node_id=node_id, objects=wire.records_to_pb(records), done=done,
            reserved=wire.reservations_to_pb(reserved, time.monotonic())))
        return [error_for_status(s, rec.key) for rec, s in zip(records, r.statuses)]

    def take_rechecks(self) -> list[tuple[str, int, str]]:
        """The replicas (key, version, segment id) heartbeat answers asked this node to
        re-check since the last call: readers reported them corrupt (master/rechecks.py)."""
        with self._lock:
            taken, self._rechecks = self._rechecks, []
        return taken

    def report_corrupt(self, keys: Sequence[str], versions: Sequence[int],
                       segment_ids: Sequence[str], node_id: str = ""
                       ) -> list[KVPoolError | None]:
        """Tell the master these replicas failed their checksum. A reader's report
        (``node_id`` ""): the master has their nodes re-check them. A node's own (its
        ``node_id``, its segments): the master drops them."""
        r = self._call("ReportCorrupt", pb.ReportCorruptRequest(
            keys=keys, versions=versions, segment_ids=segment_ids, node_id=node_id))
        return [error_for_status(s, k) for k, s in zip(keys, r.statuses)]

    # -- objects --
    def put_start(self, keys: Sequence[str], sizes: Sequence[int], replicas: int = 0,
                  parents: Sequence[str | None] | None = None
                  ) -> tuple[list[tuple[Replica, ...] | KVPoolError], float]:
        """Allocate; ``parents``: parallel to ``keys``, the block each extends (None: none)."""
        out, put_timeout_s, _ = self.put_start_grant(keys, sizes, replicas, parents)
        return out, put_timeout_s

    def put_start_grant(self, keys: Sequence[str], sizes: Sequence[int], replicas: int = 0,
                        parents: Sequence[str | None] | None = None, *, fenced: bool = False,
                        slots: bool = False, held: bool = False
                        ) -> tuple[list[tuple[Replica, ...] | KVPoolError], float, PutGrant]:
        """:meth:`put_start`, with the grant a writer hands its nodes (RESERVE, SEAL:
        net/data_port.py). ``fenced``: the writer will reserve each extent at its node before
        writing and seal it after, so the master answers without waiting for the nodes.
        ``slots``: the keys are placeholders, filled later (:meth:`put_end` ``as_keys``)."""
        r = self._lookup(lookup_port.PUT_START, "PutStart", pb.PutStartRequest(
            keys=keys, sizes=sizes, replicas=replicas,
            parents=[p or "" for p in parents] if parents and any(parents) else (),
            fenced=fenced or slots, slots=slots, held=held), pb.PutStartResponse)
        placed = wire.replicas_from_columns(r.replicas, sizes)
        out = [error_for_status(s, k) or p for k, s, p in zip(keys, r.statuses, placed)]
        if r.space_summary:   # say how much was asked, and how much room there is
            copies = f"x{replicas}" if replicas else "the default replicas"
            out = [NoSpace(f"{k!r}: no room for {size} bytes ({copies}); {r.space_summary}")
                   if type(o) is NoSpace else o for k, size, o in zip(keys, sizes, out)]
        if r.quota_summary:
            out = [QuotaExceeded(f"{k!r}: {size} bytes more would pass the quota: "
                                 f"{r.quota_summary}")
                   if type(o) is QuotaExceeded else o for k, size, o in zip(keys, sizes, out)]
        return out, r.put_timeout_s, PutGrant(r.epoch, list(r.versions), r.hold_s, r.tenant,
                                              _first_held(out, r.held_grants))

    def put_end(self, keys: Sequence[str], checksums: Sequence[int | None] | None = None,
                *, sealed: bool = False, as_keys: Sequence[str] = (),
                sizes: Sequence[int] = (), parents: Sequence[str | None] | None = None
                ) -> list[KVPoolError | None]:
        """Commit; ``checksums``: each object's CRC-32C (common/checksum.py), or None.
        ``sealed``: every replica was sealed at its node (the answer waits for no node).
        ``as_keys`` (with ``sizes``, ``parents``): ``keys`` are slots, each filled with the
        value of ``as_keys[i]`` (of ``sizes[i]`` bytes): errors then name ``as_keys``."""
        r = self._lookup(lookup_port.PUT_END, "PutEnd", pb.PutEndRequest(
            keys=keys, checksums=[checksum.encode(c) for c in checksums] if checksums else (),
            sealed=sealed, as_keys=as_keys, sizes=sizes,
            parents=[p or "" for p in parents] if parents and any(parents) else ()),
            pb.StatusesResponse)
        return [error_for_status(s, k) for k, s in zip(as_keys or keys, r.statuses)]

    def put_revoke(self, keys: Sequence[str]) -> list[KVPoolError | None]:
        r = self._lookup(lookup_port.PUT_REVOKE, "PutRevoke", pb.KeysRequest(keys=keys),
                         pb.StatusesResponse)
        return [error_for_status(s, k) for k, s in zip(keys, r.statuses)]

    def remove(self, keys: Sequence[str]) -> list[KVPoolError | None]:
        return self._statuses("Remove", keys)

    def exists(self, keys: Sequence[str]) -> list[bool]:
        r = self._lookup(lookup_port.EXISTS, "Exists", pb.KeysRequest(keys=keys),
                         pb.StatusesResponse)
        return [s == pb.STATUS_OK for s in r.statuses]

    def locate(self, keys: Sequence[str]) -> Located:
        """Each key's size, version, checksum and replicas, leasing each object found (see
        :class:`Located`): columns, with no Python object per key until one is asked for."""
        return located(keys, self._lookup(
            lookup_port.GET_REPLICAS, "GetReplicas", pb.KeysRequest(keys=keys, packed=True),
            pb.GetReplicasResponse))

    def locate_answer(self, keys: Sequence[str], held: bool = False
                      ) -> pb.GetReplicasResponse:
        """:meth:`locate`'s answer as it came (``located(keys, answer)`` makes the columns):
        a single get reads its one replica from it directly (rpc/located.py only_replica).
        ``held``: with READ_HELD grants too (``held_grants``, one per replica)."""
        return self._lookup(lookup_port.GET_REPLICAS, "GetReplicas",
                            pb.KeysRequest(keys=keys, held=held), pb.GetReplicasResponse)

    def _lookup_channel(self):
        """The lookup port's channel, learning the port first (an empty GetReplicas) when
        this master never named it to us; None if it has none we use."""
        if self._lookups.wants_port(address := self.address):
            self._lookups.learn(address, self._call("GetReplicas", pb.KeysRequest()).lookup_port)
        return self._lookups.channel_for(address)

    def spin(self, seconds: float) -> None:
        """Ask the master to keep polling its lookup port for ``seconds``: this client's next
        call comes after that long of its own work (net/lookup_port.py SPIN). A hint: nothing
        is sent where no lookup connection is open."""
        if (channel := self._lookups.channel_for(self.address)) is not None:
            channel.spin(seconds)

    def _lookup(self, method: int, rpc: str, request, response_type):
        """``rpc`` on the master's lookup port where it has one we reach, else over gRPC. A
        call the port lost (LookupLost) is asked again over gRPC: for a put call that the
        master may have carried out, as gRPC's own retry after UNAVAILABLE does (DESIGN.md,
        "Calls cut by a master kill")."""
        if (r := self._call_port(self._lookups, method, request, response_type)) is not None:
            return r
        r = self._call(rpc, request)
        if method == lookup_port.GET_REPLICAS:
            self._lookups.learn(self.address, r.lookup_port)
        else:   # a client that only puts or asks Exists learns the port this way
            self._lookup_channel()
        return r

    def close(self) -> None:
        self._lookups.close()
        super().close()
        self.end_watches()   # a manifest stream on the lookup port is a socket of our own

    def pin(self, keys: Sequence[str], ttl_s: float | None = None) -> list[KVPoolError | None]:
        """Hard pins (``ttl_s=None``) or soft pins for ``ttl_s`` seconds; per key None or the
        error (ObjectNotFound, NoSpace past the hard-pin quota)."""
        r = self._call("Pin", pb.PinRequest(keys=keys, ttl_s=ttl_s or 0.0))
        return [error_for_status(s, k) for s, k in zip(r.statuses, keys)]

    def unpin(self, keys: Sequence[str]) -> list[KVPoolError | None]:
        r = self._call("Pin", pb.PinRequest(keys=keys, unpin=True))
        return [error_for_status(s, k) for s, k in zip(r.statuses, keys)]

    def stats(self, audit: bool = False) -> pb.StatsResponse:
        """The cluster's statistics; ``audit``: with each segment's ``indexed_bytes`` (the
        master sums every indexed object: for checkers, not for polling)."""
        return self._call("Stats", pb.StatsRequest(audit=audit))

    def _statuses(self, method: str, keys: Sequence[str]) -> list[KVPoolError | None]:
        r = self._call(method, pb.KeysRequest(keys=keys))
        return [error_for_status(s, k) for k, s in zip(keys, r.statuses)]


def located(keys: Sequence[str], r: pb.GetReplicasResponse) -> Located:
    """A GetReplicas answer about ``keys`` in columns, packed or not (KeysRequest.packed);
    TransportError if it does not add up."""
    if r.packed:
        statuses, sizes, versions, sums = wire.unpack_columns(r.packed, len(keys), 4)[0]
        statuses = statuses.astype(np.int32)
    else:
        statuses = np.array(r.statuses, dtype=np.int32)
        sizes = np.array(r.sizes, dtype=np.uint64)
        versions = np.array(r.versions, dtype=np.uint64)
        sums = np.array(r.checksums, dtype=np.uint64)
        if len(sums) != len(sizes):   # a master that recorded none
            sums = np.zeros_like(sizes)
    if not len(statuses) == len(sizes) == len(versions) == len(keys):
        raise TransportError(f"malformed answer: {len(statuses)} statuses for {len(keys)} keys")
    return Located(keys=keys, statuses=statuses, sizes=sizes, versions=versions, checksums=sums,
                   replicas=wire.replica_arrays(r.replicas, len(keys)),
                   lease_ttl_s=r.lease_ttl_s)


def _first_held(placed: list, joined: bytes) -> list[bytes]:
    """Each key's READ_HELD grant over its first replica, from ``joined`` (one per replica,
    in order); b"" for a key refused, or where none came."""
    size, out, at = capabilities.GRANT.size, [], 0
    for p in placed:
        n = 0 if isinstance(p, KVPoolError) else len(p)
        out.append(joined[at:at + size] if n and len(joined) >= at + size else b"")
        at += n * size
    return out
