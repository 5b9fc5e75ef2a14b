"""The store node's data port and shm hand-off: the framing, and what each end does with it.

The node's end is :class:`kvpool.store_node.data_server.DataServer`; the client's ends are the
tcp transport (READ/WRITE), the rdma transport (CONNECT_QP) and the shm transport (hand-off).
Both use the functions here: checking a request (:func:`malformed_request`), answering
(:func:`send_reply`, :func:`send_refusal`), and reading a refusal (:func:`recv_refusal`).

Request:  header ``!4sBxHQQ`` = magic b"KVP1", op, pad, segment id length, offset, length;
          then the segment id (utf-8); then, for WRITE, ``length`` payload bytes.
Response: header ``!B3xQ`` = status, pad, payload length; then the payload: the bytes read
          (READ, status OK) or a utf-8 error message (status != OK).
Responses come in request order, so a client may pipeline requests on one connection.
After a BAD_REQUEST (malformed frame) or a refused WRITE the server closes the connection,
because it cannot know where the next frame starts.

shm hand-off trust: the node answers only peers it trusts by their SO_PEERCRED uid/gid
(DENIED otherwise, and closes). A request without ``HANDOFF_WRITABLE`` gets a read-only fd of
the segment (its inode owner-only, so it cannot be reopened writable through /proc); with it,
the writable fd, for trusted writers only (DENIED for a read-only peer, connection kept).

RESERVE and SEAL (a put's record, handed by its writer; on the data port, and on the shm
hand-off socket after the marker ``HANDOFF_RESERVE``/``HANDOFF_SEAL`` in place of a length):
the header's segment id, offset and length name the extent; a ``RECORD`` body
(``!QQdIBxHH`` = master epoch, version, hold seconds, CRC-32C, flags, key length, parent
length) and the key and parent (utf-8) follow the segment id. RESERVE (before the bytes are
written) records the extent as the key's, refused STALE_EPOCH unless the epoch is the node's
current master's; SEAL (after) checks the extent's bytes against the CRC (CHECKSUM_MISMATCH
if they differ) and keeps the record as a commit pending the master's word. Each is answered
OK with no payload, or refused with a message; the connection stays usable either way.
On the shm socket the marker is followed by ``HANDOFF_RECORD`` (``!HQQ`` = segment id length,
offset, length), the ``RECORD`` body, the segment id, the key and the parent. There a trusted
writer may ask for its connection's seal board (``HANDOFF_BOARD`` in place of a length;
answered as a segment's hand-off) and name a cell of it in a slot's RESERVE (flag
``RECORD_HAS_CELL``, the cell's index in the CRC field): it then seals that slot's put by
filling the cell, with no SEAL frame (net/seal_board.py). Any trusted peer may ask for the
node's index of its committed objects (``HANDOFF_INDEX``; net/shm_index.py), to read them
without asking the master where they are.

Grants (common/capabilities.py): a request whose magic is ``MAGIC_GRANTED`` (b"KVP2") carries
the master's grant for its extent (``capabilities.GRANT``: version, expiry, MAC; 32 bytes)
right after the segment id. A node given a key by its master serves READ, WRITE, RESERVE and
SEAL only with a grant that covers the operation (READ; WRITE for the other three) on exactly
that extent, unexpired, refusing DENIED otherwise (a refused WRITE closes the connection, as
always); a WRITE spends its grant. A node without a key (no master, or one that mints none)
takes requests with or without grants alike.

READ_HELD: a READ of a committed object the client placed or located before (its own single
put, or a single get), under a READ_HELD grant (common/capabilities.py) of the extent the master
placed it in (the object, or the slot it filled) and of its version. The node serves the
object its manifest holds at the extent's start with that version, at most the extent long
(committed, in a segment its index covers: store_node/manifest.py), else refuses it NOT_HELD
(the client asks the master). Answered OK with the object's size plus ``HELD_TRAILER.size`` as
the payload length: the bytes, then ``HELD_TRAILER``, 1 if the node still held the object after
sending them (the bytes are the object's), 0 if it was dropped meanwhile (discard them).

CONNECT_QP (the RDMA queue-pair handshake): segment id empty, offset 0, length =
``QP_INFO.size``, followed by the client's ``QP_INFO`` (``!II16sB3x``: QP number, starting PSN,
GID as 16 raw bytes, path MTU as the verbs enum 1..5 = 256..4096 bytes). The node creates an RC
queue pair, brings it to ready-to-receive with the client's values, and answers OK with its
own ``QP_INFO``; or UNSUPPORTED (no RDMA device) with a message, keeping the connection. The
node's queue pair lives as long as that tcp connection: the client keeps it open (its EOF also
tells the client that the node died), and closing it tears the queue pair down.

RKEY_READ and RKEY_WRITE (on the CONNECT_QP connection, after the handshake): the header names
an extent, a grant follows the segment id as for READ and WRITE (checked as one: an RKEY_WRITE
spends its write grant), and the node registers a memory region over exactly that extent, for
remote reads or remote writes only, answering OK with ``RKEY`` (``!QI4x``: the region's remote
address, its rkey). Segments themselves are registered for local access only, so a client
never holds an rkey that reaches bytes it was not granted. A region lives until its grant
expires (``UNGRANTED_REGION_S`` after it was asked for without a grant), a write region until
the master's commit of its extent reaches the node too (a committed object is never writable
again), and none outlives its connection; a connection's ``MAX_REGIONS_PER_CONNECTION + 1``-th
region closes its oldest. Refused with a message (DENIED, OUT_OF_BOUNDS, UNKNOWN_SEGMENT,
UNSUPPORTED: no RDMA, or registering failed); the connection stays usable either way.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum

from kvpool.common import capabilities
from kvpool.common.errors import TransportError
from kvpool.net.sockets import recv_exact, send_all

MAGIC = b"KVP1"
MAGIC_GRANTED = b"KVP2"   # a grant follows the segment id
GRANT_BYTES = capabilities.GRANT.size
REQUEST = struct.Struct("!4sBxHQQ")
RESPONSE = struct.Struct("!B3xQ")
MAX_SEGMENT_ID_BYTES = 1024
# shm hand-off over the node's unix socket: this header + segment id; the reply is a RESPONSE
# (OK with the segment size as its length, and the segment's fd attached) or an error.
HANDOFF_REQUEST = struct.Struct("!H")
MAX_ERROR_BYTES = 4096
# A put's record (RESERVE, SEAL): epoch, version, hold_s, crc, flags, key length, parent length.
RECORD = struct.Struct("!QQdIBxHH")
RECORD_HAS_CRC = 1
RECORD_HAS_PARENT = 2
# RESERVE on the shm hand-off socket only: the writer will seal this slot's put in its seal
# board's cell whose index the CRC field holds (net/seal_board.py).
RECORD_HAS_CELL = 4
MAX_KEY_BYTES = 4096
# On the shm hand-off socket, these values in place of a segment id length (at most
# MAX_SEGMENT_ID_BYTES) start a RESERVE or SEAL; HANDOFF_RECORD follows.
HANDOFF_RESERVE = 0xFFF1
HANDOFF_SEAL = 0xFFF2
# And this one asks for the connection's seal board (net/seal_board.py): answered OK with its
# size as the length and its fd attached, as a segment's hand-off is.
HANDOFF_BOARD = 0xFFF3
# And this one (any trusted peer, reader or writer) asks for the node's index of its committed
# objects (net/shm_index.py): answered OK with its size and a read-only fd, or UNSUPPORTED.
HANDOFF_INDEX = 0xFFF4
HANDOFF_RECORD = struct.Struct("!HQQ")
# Or'ed into a hand-off request's segment id length: the writable fd (trusted writers only);
# without it the node hands a read-only fd, which the client maps PROT_READ.
HANDOFF_WRITABLE = 0x8000


class Op(IntEnum):
    READ = 1
    WRITE = 2
    CONNECT_QP = 3
    RESERVE = 4
    SEAL = 5
    RKEY_READ = 6
    RKEY_WRITE = 7
    READ_HELD = 8


class FrameStatus(IntEnum):
    OK = 0
    BAD_REQUEST = 1        # malformed frame: bad magic, unknown op, oversized segment id
    OUT_OF_BOUNDS = 2      # offset/length outside the segment
    UNKNOWN_SEGMENT = 3    # no such segment mounted on this node
    UNSUPPORTED = 4        # a valid request this node cannot serve (CONNECT_QP without RDMA)
    STALE_EPOCH = 5        # RESERVE/SEAL granted by a master that is not this node's current one
    CHECKSUM_MISMATCH = 6  # SEAL: the extent's bytes do not match the record's CRC-32C
    DENIED = 7             # the peer may not do this: an shm peer the node does not trust
    CONFLICT = 8           # SEAL: the space was released, or a slot's key is held in another record
    NOT_HELD = 9           # READ_HELD: the node does not hold that object there (any more)


# After a READ_HELD's bytes: 1 if the node held the object from before it sent them until
# after, else 0 (the client discards what it read and asks the master).
HELD_TRAILER = struct.Struct("!Q")

QP_INFO = struct.Struct("!II16sB3x")
RKEY = struct.Struct("!QI4x")
# Regions one connection may hold at once (one more closes its oldest). A region is a few
# hundred bytes of the device's tables; rxe holds ~256K in all.
MAX_REGIONS_PER_CONNECTION = 4096
# A region asked for without a grant (a node whose master mints none) lives this long.
UNGRANTED_REGION_S = 60.0


def encode_qp_info(qp_num: int, psn: int, gid: str, mtu: int) -> bytes:
    """One side of the CONNECT_QP handshake; ``gid`` as "fe80:0000:..." (8 x 4 hex digits)."""
    return QP_INFO.pack(qp_num, psn, bytes.fromhex(gid.replace(":", "")), mtu)


def decode_qp_info(data: bytes) -> tuple[int, int, str, int]:
    """(qp_num, psn, gid, mtu) from a ``QP_INFO`` payload; ValueError if malformed."""
    qp_num, psn, raw_gid, mtu = QP_INFO.unpack(data)
    if not 1 <= mtu <= 5 or psn >= 1 << 24:
        raise ValueError(f"bad QP info: mtu enum {mtu}, psn {psn}")
    hexgid = raw_gid.hex()
    return qp_num, psn, ":".join(hexgid[i:i + 4] for i in range(0, 32, 4)), mtu


def encode_request(op: Op, segment_id: str, offset: int, length: int,
                   grant: bytes = b"") -> bytes:
    """A request header and segment id, and ``grant`` (the master's, for this extent) if any."""
    sid = segment_id.encode()
    magic = MAGIC_GRANTED if grant else MAGIC
    return REQUEST.pack(magic, op, len(sid), offset, length) + sid + grant


def encode_response(status: FrameStatus, payload_length: int) -> bytes:
    return RESPONSE.pack(status, payload_length)


_STATUSES = frozenset(s.value for s in FrameStatus)


@dataclass(frozen=True, slots=True)
class PutRecord:
    """What a writer tells a node of one replica of its put (RESERVE, SEAL)."""

    key: str
    version: int
    epoch: int            # of the master that granted the put
    hold_s: float         # how long the node keeps the reservation (RESERVE)
    checksum: int | None = None   # CRC-32C of the bytes (SEAL)
    parent: str | None = None
    cell: int | None = None       # the seal board cell of a slot (RESERVE on shm)


def encode_record(record: PutRecord, sid: bytes = b"") -> bytes:
    """The RECORD body, then ``sid`` (the shm socket's order), the key and the parent."""
    key = record.key.encode()
    parent = (record.parent or "").encode()
    flags = (RECORD_HAS_CRC if record.checksum is not None else 0) | \
        (RECORD_HAS_PARENT if record.parent else 0) | \
        (RECORD_HAS_CELL if record.cell is not None else 0)
    crc = record.cell if record.cell is not None else record.checksum or 0
    return RECORD.pack(record.epoch, record.version, record.hold_s, crc,
                       flags, len(key), len(parent)) + sid + key + parent


def encode_record_request(op: Op, segment_id: str, offset: int, length: int,
                          record: PutRecord, grant: bytes = b"") -> bytes:
    """A RESERVE or SEAL frame for the data port (with the extent's write grant, if any)."""
    return encode_request(op, segment_id, offset, length, grant) + encode_record(record)


def encode_handoff_record(op: Op, segment_id: str, offset: int, length: int,
                          record: PutRecord) -> bytes:
    """A RESERVE or SEAL for the shm hand-off socket."""
    sid = segment_id.encode()
    marker = HANDOFF_RESERVE if op is Op.RESERVE else HANDOFF_SEAL
    return (HANDOFF_REQUEST.pack(marker) + HANDOFF_RECORD.pack(len(sid), offset, length)
            + encode_record(record, sid))


def recv_record(recv: Callable[[int], bytes], *, sid_len: int | None = None
                ) -> tuple[str, PutRecord] | str:
    """Read a RECORD body (and first the segment id, when ``sid_len`` is given: the shm
    socket's order) with ``recv(n)`` (exactly n bytes); (segment id or "", record), or why the
    body is malformed (the connection cannot be trusted after it)."""
    try:
        epoch, version, hold_s, crc, flags, key_len, parent_len = RECORD.unpack(recv(RECORD.size))
        if key_len == 0 or key_len > MAX_KEY_BYTES or parent_len > MAX_KEY_BYTES \
                or not hold_s >= 0 \
                or flags & ~(RECORD_HAS_CRC | RECORD_HAS_PARENT | RECORD_HAS_CELL) \
                or flags & RECORD_HAS_CELL and (flags & RECORD_HAS_CRC or sid_len is None):
            return "malformed put record"
        sid_len = sid_len or 0
        tail = recv(sid_len + key_len + parent_len)   # one read: a put waits for this reply
        sid = tail[:sid_len].decode()
        key = tail[sid_len:sid_len + key_len].decode()
        parent = tail[sid_len + key_len:].decode() if parent_len else None
    except UnicodeDecodeError:
        return "put record is not utf-8"
    return sid, PutRecord(key, version, epoch, hold_s,
                          crc if flags & RECORD_HAS_CRC else None,
                          parent if flags & RECORD_HAS_PARENT else None,
                          crc if flags & RECORD_HAS_CELL else None)


# ---------------------------------------------------------------- the client's end

def encode_handoff_request(segment_id: str, writable: bool = False) -> bytes:
    sid = segment_id.encode("utf-8")
    return HANDOFF_REQUEST.pack(len(sid) | (HANDOFF_WRITABLE if writable else 0)) + sid


def recv_refusal(sock: socket.socket, status: int, length: int, what: str = "node") -> str:
    """The message that follows a reply header whose status is not OK; TransportError if the
    header is not a refusal this protocol knows (the stream cannot be trusted after it)."""
    if status not in _STATUSES or status == FrameStatus.OK or length > MAX_ERROR_BYTES:
        raise TransportError(f"malformed reply: status {status}, {length}-byte message")
    return recv_exact(sock, length, what).decode("utf-8", "replace")


# ---------------------------------------------------------------- the node's end

def malformed_request(magic: bytes, op: int, sid_len: int, offset: int, length: int) -> str:
    """Why a request header breaks the framing ("" if it does not): the node answers
    BAD_REQUEST and closes, since it cannot know where the next frame starts."""
    if magic != MAGIC and magic != MAGIC_GRANTED:
        return f"bad magic {bytes(magic)!r}"
    if op == Op.CONNECT_QP:
        ok = magic == MAGIC and not sid_len and not offset and length == QP_INFO.size
        return "" if ok else "malformed CONNECT_QP"
    if op not in (Op.READ, Op.WRITE, Op.RESERVE, Op.SEAL, Op.RKEY_READ, Op.RKEY_WRITE,
                  Op.READ_HELD):
        return f"unknown op {op}"
    return check_segment_id_length(sid_len)


def check_segment_id_length(sid_len: int) -> str:
    if sid_len > MAX_SEGMENT_ID_BYTES:
        return f"segment id of {sid_len} bytes (limit {MAX_SEGMENT_ID_BYTES})"
    return ""


def send_reply(sock: socket.socket, status: FrameStatus, payload: bytes | memoryview = b"") -> None:
    send_all(sock, [encode_response(status, len(payload)), payload])


def send_refusal(sock: socket.socket, status: FrameStatus, message: str) -> None:
    send_reply(sock, status, message.encode())

