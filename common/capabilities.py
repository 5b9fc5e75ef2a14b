"""Grants: what a client may do to a byte range of a store node, minted by the master.

The master keeps a random key per store node and hands it to the node at MountSegment. With
every placement (PutStart: WRITE) and location (GetReplicas: READ) it mints, per replica, a
grant: the object's version, an expiry, and a MAC under that node's key over the operation,
the segment, the offset, the length, the version and the expiry. The client sends the grant,
opaque to it, with each tcp READ or WRITE (net/data_port.py); the node checks the MAC before it
touches a byte (:func:`check`). So a client reaches only the extents the master placed or
located for it, only for the operation granted, and only until the grant expires; a WRITE
grant is spent by its first WRITE (store_node/data_server.py), so a committed object is never
writable again. A READ_HELD grant (asked for with a single get's GetReplicas, or a single put's
PutEnd) lets its holder read that object again with no master call for ``HELD_GRANT_S``: the
node serves it only while its manifest holds the grant's version at that extent, so it reads
nothing but the object it was minted for, whatever the space holds later.

A write grant (PutStart's) also carries a record tag: a MAC over the same extent, version and
expiry under the operation ``RECORD`` and the object's stored key (common/tenants.py). A writer
sends it (:func:`record_grant`) with the RESERVE and SEAL that hand its node the put's record,
and the node checks it against the record's key: a writer can record at its node only the key
the master placed there, so no client can make a node's manifest name another key (another
tenant's) at its extent, nor drop that key's record there. The client strips it from its
WRITEs (:func:`write_grant`); the frames carry 32-byte grants either way.

A READ or WRITE grant's MAC is AES-CBC-MAC over two blocks, ``offset | op << 56 | length``
then ``version | expiry`` (the grant's own first 16 bytes), under a key per segment derived from
the node's key with keyed BLAKE2b: CBC-MAC is a secure MAC for messages of one fixed length, and
every grant's is 32 bytes. Why AES: the master mints a grant per replica of every lookup, and a
batch's are two AES-ECB calls over all of them (:meth:`Signer.mint_many`), where a hash per grant
was a third of the master's time in a 256-key lookup. A record tag (its message holds a key of
any length) is keyed BLAKE2b truncated to 128 bits. MACs, not signatures: only the master and
that node hold the key. Expiries are unix milliseconds: master and node clocks must agree to
within the grant's slack (``READ_GRANT_MIN_S``).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct
import threading
import time

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

# The operations a grant names (equal to net.data_port.Op's READ, WRITE and READ_HELD), and a
# put's record (RESERVE, SEAL) of one key.
READ = 1
WRITE = 2
RECORD = 3
#: A read the node serves only while its manifest holds the grant's version at the extent
#: (net/data_port.py READ_HELD): no lease protects it, so it may live long.
READ_HELD = 8
KEY_BYTES = 32
TAG_BYTES = 16
#: A grant on the wire: version, expiry (unix ms), MAC.
GRANT = struct.Struct(f"!QQ{TAG_BYTES}s")
_SEGMENT = struct.Struct("!H")          # the MAC's input: segment id length, segment id, then
_FIELDS = struct.Struct("!BQQQQ")       # op, offset, length, version, expiry (record tags)
_BLOCK = struct.Struct("!QQ")           # an AES block of two fields (READ, WRITE grants)
_OP_SHIFT = 56                          # the op rides in the length's top byte
_MAX_LENGTH = 1 << _OP_SHIFT
_AES_PERSON = b"kvpool.grant.aes"       # the derived key's domain (record tags have none)
#: Fewer grants than this are minted one by one: numpy's set-up costs more than it saves.
_BATCH_MIN = 8
#: A read grant lives at least this long (a lease may be shorter): a client reads right after
#: it locates, and a clock skew smaller than this does not refuse it.
READ_GRANT_MIN_S = 30.0
#: A READ_HELD grant's life: the node checks the object is still there, so the grant only
#: bounds how long a client may keep reading an object it was once shown.
HELD_GRANT_S = 600.0
_MAX_CACHED_SEGMENTS = 1 << 16


def new_key() -> bytes:
    """A fresh random per-node key."""
    return secrets.token_bytes(KEY_BYTES)


def expiry_ms(ttl_s: float, now_s: float | None = None) -> int:
    """The expiry of a grant that lives ``ttl_s`` from ``now_s`` (default: now)."""
    return int(((time.time() if now_s is None else now_s) + ttl_s) * 1000)


class Signer:
    """Mints and checks grants under one node's key. Per segment it keeps an AES-ECB encryptor
    under the key derived for it, one per thread (ECB holds no state between calls, but a
    node checks grants on many threads) and the record tags' hash state keyed and fed the
    segment id, copied per tag."""

    def __init__(self, key: bytes) -> None:
        self.key = key
        self._by_segment: dict[bytes, object] = {}
        self._local = threading.local()

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

    def _encrypt(self, segment_id: bytes):
        """This thread's AES-ECB encryptor under ``segment_id``'s key: its ``update``."""
        mine = getattr(self._local, "by_segment", None)
        if mine is None:
            mine = self._local.by_segment = {}
        update = mine.get(segment_id)
        if update is None:
            if len(mine) >= _MAX_CACHED_SEGMENTS:
                mine.clear()
            key = hashlib.blake2b(_SEGMENT.pack(len(segment_id)) + segment_id, key=self.key,
                                  digest_size=32, person=_AES_PERSON).digest()
            update = mine[segment_id] = Cipher(algorithms.AES(key), modes.ECB()).encryptor().update
        return update

    @staticmethod
    def _first(op: int, offset: int, length: int) -> bytes:
        if not 0 <= length < _MAX_LENGTH:
            raise ValueError(f"a grant's length must be below 2**{_OP_SHIFT}: {length}")
        return _BLOCK.pack(offset, op << _OP_SHIFT | length)

    def _mac(self, op: int, segment_id: bytes, offset: int, length: int, head: bytes) -> bytes:
        """The tag of one READ or WRITE grant whose first 16 bytes are ``head``."""
        encrypt = self._encrypt(segment_id)
        chained = int.from_bytes(encrypt(self._first(op, offset, length)), "big") \
            ^ int.from_bytes(head, "big")
        return encrypt(chained.to_bytes(TAG_BYTES, "big"))

    def mint_many(self, op: int, segment_id: bytes, offsets, lengths, versions, expiry: int,
                  keys=None, joined: bool = False) -> list[bytes] | bytes:
        """:meth:`mint` for the extents ``offsets[i], lengths[i]`` of objects
        ``versions[i]`` in one segment (the master's loop: one call per segment of a batch,
        not per replica). ``keys``: each one's stored key: WRITE grants then carry its record
        tag. ``joined`` (no ``keys``): the grants in one bytes object, one after another."""
        if joined and keys is not None:
            raise ValueError("grants with record tags are not joined")
        n = len(offsets)
        if n < _BATCH_MIN:
            out = [self.mint(op, segment_id, offsets[i], lengths[i], versions[i], expiry)
                   for i in range(n)]
        else:
            fields = np.empty((n, 4), dtype=">u8")
            fields[:, 0] = offsets
            fields[:, 1] = lengths
            if int(fields[:, 1].max()) >= _MAX_LENGTH:
                raise ValueError(f"a grant's length must be below 2**{_OP_SHIFT}")
            fields[:, 1] |= op << _OP_SHIFT
            fields[:, 2] = versions
            fields[:, 3] = expiry
            raw = fields.view(np.uint8)   # n rows: block one, then the grant's head
            encrypt = self._encrypt(segment_id)
            grants = np.empty((n, GRANT.size), dtype=np.uint8)
            grants[:, :16] = raw[:, 16:]
            chained = np.frombuffer(encrypt(raw[:, :16].tobytes()), np.uint8).reshape(n, 16)
            grants[:, 16:] = np.frombuffer(encrypt((chained ^ raw[:, 16:]).tobytes()),
                                           np.uint8).reshape(n, 16)
            flat, size = grants.tobytes(), GRANT.size
            if joined:
                return flat
            out = [flat[i:i + size] for i in range(0, n * size, size)]
        if keys is not None:
            for i, key in enumerate(keys):
                out[i] += self._record_tag(segment_id, offsets[i], lengths[i], versions[i],
                                           expiry, key.encode())
        return b"".join(out) if joined else out

    def _record_tag(self, segment_id: bytes, offset: int, length: int, version: int,
                    expiry: int, key: bytes) -> bytes:
        h = self.segment_state(segment_id).copy()
        h.update(_FIELDS.pack(RECORD, offset, length, version, expiry) + key)
        return h.digest()

    def mint(self, op: int, segment_id: bytes, offset: int, length: int, version: int,
             expiry: int) -> bytes:
        """A grant for ``op`` (READ or WRITE) on ``[offset, offset + length)`` of
        ``segment_id``, as sent."""
        head = _BLOCK.pack(version, expiry)
        return head + self._mac(op, segment_id, offset, length, head)

    def check(self, grant: bytes, op: int, segment_id: bytes, offset: int, length: int,
              now_ms: float | None = None, key: bytes = b"") -> tuple[int, str]:
        """(the grant's version, "") if ``grant`` allows ``op`` on the extent now (RECORD:
        of the stored ``key``, utf-8); else (0, why)."""
        if len(grant) != GRANT.size:
            return 0, "no grant for this extent"
        version, expiry, tag = GRANT.unpack(grant)
        if op == RECORD:
            expected = self._record_tag(segment_id, offset, length, version, expiry, key)
        elif 0 <= length < _MAX_LENGTH:
            expected = self._mac(op, segment_id, offset, length, grant[:16])
        else:
            expected = b""
        if not hmac.compare_digest(tag, expected):
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
    [grant] = Signer(key).mint_many(op, segment_id.encode(), [offset], [length], [version],
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
