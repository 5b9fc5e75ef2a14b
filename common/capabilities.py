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

# The operations a grant names (equal to net.data_port.Op's READ and WRITE).
READ = 1
WRITE = 2
KEY_BYTES = 32
TAG_BYTES = 16
#: A grant on the wire: version, expiry (unix ms), MAC.
GRANT = struct.Struct(f"!QQ{TAG_BYTES}s")
_SIGNED = struct.Struct("!BQQQQH")   # op, offset, length, version, expiry, segment id length
#: A read grant lives at least this long (a lease may be shorter): a client reads right after
#: it locates, and a clock skew smaller than this does not refuse it.
READ_GRANT_MIN_S = 30.0


def new_key() -> bytes:
    """A fresh random per-node key."""
    return secrets.token_bytes(KEY_BYTES)


def _tag(key: bytes, op: int, segment_id: bytes, offset: int, length: int, version: int,
         expiry_ms: int) -> bytes:
    signed = _SIGNED.pack(op, offset, length, version, expiry_ms, len(segment_id)) + segment_id
    return hashlib.blake2b(signed, key=key, digest_size=TAG_BYTES).digest()


def mint(key: bytes, op: int, segment_id: str, offset: int, length: int, version: int,
         expiry_ms: int) -> bytes:
    """A grant for ``op`` on ``[offset, offset + length)`` of ``segment_id``, as sent."""
    return GRANT.pack(version, expiry_ms,
                      _tag(key, op, segment_id.encode(), offset, length, version, expiry_ms))


def expiry_ms(ttl_s: float, now_s: float | None = None) -> int:
    """The expiry of a grant that lives ``ttl_s`` from ``now_s`` (default: now)."""
    return int(((time.time() if now_s is None else now_s) + ttl_s) * 1000)


def check(key: bytes, grant: bytes, op: int, segment_id: bytes, offset: int, length: int,
          now_ms: int | None = None) -> tuple[int, str]:
    """(the grant's version, "") if ``grant`` allows ``op`` on the extent now; else (0, why)."""
    if len(grant) != GRANT.size:
        return 0, "no grant for this extent"
    version, expiry, tag = GRANT.unpack(grant)
    if not hmac.compare_digest(tag, _tag(key, op, segment_id, offset, length, version, expiry)):
        return 0, "the grant does not cover this operation on this extent"
    if expiry < (time.time() * 1000 if now_ms is None else now_ms):
        return 0, "the grant has expired"
    return version, ""
