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

SPIN (a ``SPIN_BODY``, ``!I`` = microseconds, at most ``MAX_SPIN_US``) is not answered: the
master keeps its loop polling that long (master/lookup_server.py; net/sockets.py
``LoopSpinner``). A client about to spend a while on its own before its next call (the copy
of a large put, before PutEnd) sends it first, so that the call does not meet a master whose
core went to sleep meanwhile (waking it costs ~0.1 ms here). Any connection's frames are
served during the spin.

A master names its lookup port in each gRPC ``GetReplicasResponse`` and ``RouteResponse``
(``lookup_port``); the client dials it on the host its gRPC calls reach.

Sessions (a master with credentials; SECURITY.md "The lookup port"): the port is plain tcp
and every connection is a session's. A peer first opens a session over authenticated gRPC
(``OpenLookupSession``, mutual TLS or a bearer token): the master answers a random session id
and a 256-bit key, kept in its memory for ``ttl_s`` and bound to the caller's identity. The
connection's first frame is SESSION: the id and 16 random bytes of the client's, in clear;
the master answers OK with 16 random bytes of its own (or UNAUTHENTICATED, and closes). Both
ends derive a key per direction from the session key and both salts (HKDF-SHA256), so no
frame of one connection is accepted on another. Every later frame's body is sealed with
AES-256-GCM under its direction's key: the nonce is the frame's number on that connection
(0, 1, ...), the header (in clear: the length is the sealed body's, tag included) is the
associated data. A frame that does not open ends the connection (UNAUTHENTICATED, in clear);
so does a frame after the session's end. The frames are authenticated and confidential as
over TLS, without TLS's record layer in the master's Python loop (README, "Security's cost").
"""

from __future__ import annotations

import os
import struct

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

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
SESSION = 10
SPIN = 11
SPIN_BODY = struct.Struct("!I")
MAX_SPIN_US = 5000
METHOD_NAMES = {GET_REPLICAS: "GetReplicas", EXISTS: "Exists", PUT_START: "PutStart",
                PUT_END: "PutEnd", PUT_REVOKE: "PutRevoke", WATCH_MANIFEST: "WatchManifest",
                ACK_MANIFEST: "AckManifest", ROUTE: "Route"}   # as the gRPC methods
# As gRPC's message limit here (rpc/wire.py GRPC_OPTIONS).
MAX_BODY_BYTES = 64 << 20
SESSION_ID_BYTES = 16
SALT_BYTES = 16
TAG_BYTES = 16                                   # AES-GCM's tag, in each sealed body
SESSION_FRAME_BYTES = SESSION_ID_BYTES + SALT_BYTES


def encode_request(method: int, body: bytes) -> bytes:
    return REQUEST.pack(MAGIC, method, len(body)) + body


def spin_s(body: bytes) -> float | None:
    """The seconds a SPIN frame's body asks for (at most ``MAX_SPIN_US``); None if malformed."""
    if len(body) != SPIN_BODY.size:
        return None
    return min(SPIN_BODY.unpack(body)[0], MAX_SPIN_US) / 1e6


def encode_response(status: int, body: bytes) -> bytes:
    return RESPONSE.pack(status, len(body)) + body


class Unsealed(Exception):
    """A sealed frame that does not open: forged, altered, replayed or out of order."""


class Seal:
    """One direction of a session's connection: frames sealed (or opened) in order, each
    under its number as the nonce."""

    __slots__ = ("_aead", "_n")

    def __init__(self, key: bytes) -> None:
        self._aead, self._n = AESGCM(key), 0

    def _nonce(self) -> bytes:
        n, self._n = self._n, self._n + 1
        return n.to_bytes(12, "big")

    def seal(self, header: struct.Struct, *fields, body: bytes) -> bytes:
        """The frame: ``header`` packed with ``fields`` and the sealed length, then the
        sealed body."""
        head = header.pack(*fields, len(body) + TAG_BYTES)
        return head + self._aead.encrypt(self._nonce(), body, head)

    def open(self, head: bytes, sealed: bytes) -> bytes:
        """The body of the frame whose header bytes are ``head``; Unsealed if it does not
        open (this connection can then carry nothing more)."""
        try:
            return self._aead.decrypt(self._nonce(), sealed, head)
        except InvalidTag:
            raise Unsealed("a lookup frame failed authentication") from None


def new_salt() -> bytes:
    return os.urandom(SALT_BYTES)


def session_seals(key: bytes, client_salt: bytes, server_salt: bytes, *, server: bool
                  ) -> tuple[Seal, Seal]:
    """(the seal for frames this end sends, the one for frames it receives) of a connection
    of the session whose key is ``key``."""
    both = HKDF(hashes.SHA256(), 64, client_salt + server_salt,
                b"kvpool lookup session v1").derive(key)
    to_master, to_client = Seal(both[:32]), Seal(both[32:])
    return (to_client, to_master) if server else (to_master, to_client)
