"""Grants: what a client may do to a byte range of a store node, minted by the master.

The master keeps a random key per store node and hands it to the node at MountSegment. With
every placement (PutStart: WRITE) and location (GetReplicas: READ) it mints, per replica, a
grant: the object's version, an expiry, and a MAC under that node's key over the operation,
the segment, the offset, the length, the version and the expiry. The client sends the grant,
opaque to it, with each tcp READ or WRITE (net/data_port.py); the node checks the MAC before it
touches a byte (:func:`check`). So a client reaches only the extents the master placed or
located for it, only for the operation granted, and only until the grant expires; a WRITE
grant is spent by its first WRITE (store_node/data_server.py), so a committed object is never
writable again.

A write grant (PutStart's) also carries a record tag: a MAC over the same extent, version and
expiry under the operation ``RECORD`` and the object's stored key (common/tenants.py). A writer
sends it (:func:`record_grant`) with the RESERVE and SEAL that hand its node the put's record,
and the node checks it against the record's key: a writer can record at its node only the key
the master placed there, so no client can make a node's manifest name another key (another
tenant's) at its extent, nor drop that key's record there. The client strips it from its
WRITEs (:func:`write_grant`); the frames carry 32-byte grants either way.

The MAC is keyed BLAKE2b (hashlib, one C call) truncated to 128 bits: a MAC, not a signature,
as only the master and that node hold the key. Expiries are unix milliseconds: master and
node clocks must agree to within the grant's slack (``READ_GRANT_MIN_S``).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct
import time

# The operations a grant names (equal to net.data_port.Op's READ and WRITE), and a put's
# record (RESERVE, SEAL) of one key.
READ = 1
WRITE = 2
RECORD = 3
KEY_BYTES = 32
TAG_BYTES = 16
#: A grant on the wire: version, expiry (unix ms), MAC.
GRANT = struct.Struct(f"!QQ{TAG_BYTES}s")
_SEGMENT = struct.Struct("!H")          # the MAC's input: segment id length, segment id, then
_FIELDS = struct.Struct("!BQQQQ")       # op, offset, length, version, expiry
#: A read grant lives at least this long (a lease may be shorter): a client reads right after
#: it locates, and a clock skew smaller than this does not refuse it.
READ_GRANT_MIN_S = 30.0
_MAX_CACHED_SEGMENTS = 1 << 16


def new_key() -> bytes:
    """A fresh random per-node key."""
    return secrets.token_bytes(KEY_BYTES)


def expiry_ms(ttl_s: float, now_s: float | None = None) -> int:
    """The expiry of a grant that lives ``ttl_s`` from ``now_s`` (default: now)."""
    return int(((time.time() if now_s is None else now_s) + ttl_s) * 1000)


class Signer:
    """Mints and checks grants under one node's key. The hash state keyed and fed the segment
    id is kept per segment and copied per grant: half the cost of hashing from the key (the
    master mints one per replica of every lookup)."""

    def __init__(self, key: bytes) -> None:
        self.key = key
        self._by_segment: dict[bytes, object] = {}

    def segment_state(self, segment_id: bytes):
        """The hash keyed and fed ``segment_id``: copy it, feed it ``_FIELDS``, digest."""
        state = self._by_segment.get(segment_id)
        if state is None:
            if len(self._by_segment) >= _MAX_CACHED_SEGMENTS:
                self._by_segment.clear()
            state = hashlib.blake2b(key=self.key, digest_size=TAG_BYTES)
            state.update(_SEGMENT.pack(len(segment_id)) + segment_id)
            self._by_segment[segment_id] = state
        return state

    def mint_many(self, op: int, segment_id: bytes, extents, expiry: int,
                  keys=None) -> list[bytes]:
        """:meth:`mint` for ``(offset, length, version)`` extents of one segment (the
        master's loop: one call per segment of a batch, not per replica). ``keys``: parallel
        to ``extents``, each one's stored key: WRITE grants then carry its record tag."""
        copy, pack, grant = self.segment_state(segment_id).copy, _FIELDS.pack, GRANT.pack
        out = []
        for offset, length, version in extents:
            h = copy()
            h.update(pack(op, offset, length, version, expiry))
            out.append(grant(version, expiry, h.digest()))
        if keys is not None:
            for i, ((offset, length, version), key) in enumerate(zip(extents, keys)):
                h = copy()
                h.update(pack(RECORD, offset, length, version, expiry) + key.encode())
                out[i] += h.digest()
        return out

    def _tag(self, op: int, segment_id: bytes, offset: int, length: int, version: int,
             expiry: int, key: bytes = b"") -> bytes:
        h = self.segment_state(segment_id).copy()
        h.update(_FIELDS.pack(op, offset, length, version, expiry) + key)
        return h.digest()

    def mint(self, op: int, segment_id: bytes, offset: int, length: int, version: int,
             expiry: int) -> bytes:
        """A grant for ``op`` on ``[offset, offset + length)`` of ``segment_id``, as sent."""
        return GRANT.pack(version, expiry,
                          self._tag(op, segment_id, offset, length, version, expiry))

    def check(self, grant: bytes, op: int, segment_id: bytes, offset: int, length: int,
              now_ms: float | None = None, key: bytes = b"") -> tuple[int, str]:
        """(the grant's version, "") if ``grant`` allows ``op`` on the extent now (RECORD:
        of the stored ``key``, utf-8); else (0, why)."""
        if len(grant) != GRANT.size:
            return 0, "no grant for this extent"
        version, expiry, tag = GRANT.unpack(grant)
        if not hmac.compare_digest(tag, self._tag(op, segment_id, offset, length, version,
                                                  expiry, key)):
            return 0, ("the grant does not cover this key's record on this extent"
                       if op == RECORD else
                       "the grant does not cover this operation on this extent")
        if expiry < (time.time() * 1000 if now_ms is None else now_ms):
            return 0, "the grant has expired"
        return version, ""


def mint(key: bytes, op: int, segment_id: str, offset: int, length: int, version: int,
         expiry_ms: int, stored_key: str | None = None) -> bytes:
    """:meth:`Signer.mint` with a one-off signer (tests, tools); ``stored_key``: a WRITE
    grant with its record tag for that key."""
    if stored_key is None:
        return Signer(key).mint(op, segment_id.encode(), offset, length, version, expiry_ms)
    [grant] = Signer(key).mint_many(op, segment_id.encode(), [(offset, length, version)],
                                    expiry_ms, [stored_key])
    return grant


def write_grant(grant: bytes) -> bytes:
    """What a WRITE sends of a write grant: the grant without its record tag."""
    return grant[:GRANT.size]


def record_grant(grant: bytes) -> bytes:
    """What a RESERVE or SEAL sends of a write grant: its version and expiry with the record
    tag (a grant without one, as sent: the node refuses it where it checks grants)."""
    return grant[:GRANT.size - TAG_BYTES] + grant[GRANT.size:] if len(grant) > GRANT.size \
        else grant


def check(key: bytes, grant: bytes, op: int, segment_id: bytes, offset: int, length: int,
          now_ms: int | None = None) -> tuple[int, str]:
    """:meth:`Signer.check` with a one-off signer (tests, tools)."""
    return Signer(key).check(grant, op, segment_id, offset, length, now_ms)
