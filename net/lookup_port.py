"""The master's lookup port: the master calls of the data path (GetReplicas, before every read;
Exists, an engine's scheduler asking what is cached; PutStart, PutEnd and PutRevoke, around
every write; Route, before every request a gateway forwards) over a kept-open tcp connection with a fixed header instead of gRPC. The master's end is :mod:`kvpool.master.lookup_server` (on its
asyncio loop), the client's :class:`kvpool.rpc.lookup.LookupChannel`; both frame with this module.

Why a second listener: on these 2-core machines a gRPC unary call costs about 0.5 ms between
busy processes and about 1.3 ms when the master slept a few ms before it (each end crosses
threads, each of which must wake), where this framing costs 0.13 and 0.4 ms (``kvpool bench``'s
small batch: a read of 512 x 64 KiB over shm copies for about 2 ms, and its lookup was as long
again). The messages stay the protobuf ones, so the master answers both ways with the same
code; gRPC stays the contract, and a client that cannot reach this port (or finds it refusing)
simply keeps using gRPC.

Request:  ``!4sB3xI`` = magic b"KVL1", method, pad, body length; then the body: the request
          message (GET_REPLICAS, EXISTS and PUT_REVOKE: ``KeysRequest``; PUT_START:
          ``PutStartRequest``; PUT_END: ``PutEndRequest``; ROUTE: the Router service's
          ``RouteRequest``).
Response: ``!B3xI`` = status (a gRPC status code's value, 0 = OK), pad, body length; then the
          body: the response message (``GetReplicasResponse``; ``PutStartResponse``;
          ``RouteResponse``; ``StatusesResponse`` for the others) or a utf-8 error message.
Requests on one connection are answered one at a time, in order; the put calls answer, as over
gRPC, once the store nodes applied what they changed (master/servicer.py ``apply_effects``). After a malformed header the
master answers INVALID_ARGUMENT and closes the connection (it cannot know where the next frame
starts). A master that does not lead (HA standby) answers UNAVAILABLE.

WATCH_MANIFEST (``WatchManifestRequest``) turns the connection into a store node's manifest
stream (master/manifest_watch.py): the master answers with one OK frame per ``ManifestChanges``
message for as long as the connection lasts, and the node acknowledges on the same connection
with ACK_MANIFEST frames (``AckManifestRequest``), which are not answered. Anything else the
node sends on it ends the stream. Its changes reach the node and its acknowledgements the
master a wake-up each, where the gRPC stream and AckManifest call cross two threads per end.

A master names its lookup port in each gRPC ``GetReplicasResponse`` and ``RouteResponse``
(``lookup_port``); the client dials it on the host its gRPC calls reach.

AUTH (a master serving bearer tokens, ``--tokens``): its lookup port also takes TLS
connections without a client certificate; such a connection's first frame is AUTH, its body
the client's bearer token (utf-8), answered OK (the connection then acts as the token's
identity) or UNAUTHENTICATED (and closed). A connection with neither a certificate nor an
accepted AUTH is refused every call, as over gRPC.
"""

from __future__ import annotations

import struct

MAGIC = b"KVL1"
REQUEST = struct.Struct("!4sB3xI")
RESPONSE = struct.Struct("!B3xI")
GET_REPLICAS = 1
EXISTS = 2
PUT_START = 3
PUT_END = 4
PUT_REVOKE = 5
WATCH_MANIFEST = 6
ACK_MANIFEST = 7
ROUTE = 8
AUTH = 9
METHOD_NAMES = {GET_REPLICAS: "GetReplicas", EXISTS: "Exists", PUT_START: "PutStart",
                PUT_END: "PutEnd", PUT_REVOKE: "PutRevoke", WATCH_MANIFEST: "WatchManifest",
                ACK_MANIFEST: "AckManifest", ROUTE: "Route"}   # as the gRPC methods
# As gRPC's message limit here (rpc/wire.py GRPC_OPTIONS).
MAX_BODY_BYTES = 64 << 20


def encode_request(method: int, body: bytes) -> bytes:
    return REQUEST.pack(MAGIC, method, len(body)) + body


def encode_response(status: int, body: bytes) -> bytes:
    return RESPONSE.pack(status, len(body)) + body
