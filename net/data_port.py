"""The tcp data-port framing shared by a store node's data server and the tcp transport.

Request:  header ``!4sBxHQQ`` = magic b"KVP1", op, pad, segment id length, offset, length;
          then the segment id (utf-8); then, for WRITE, ``length`` payload bytes.
Response: header ``!B3xQ`` = status, pad, payload length; then the payload: the bytes read
          (READ, status OK) or a utf-8 error message (status != OK).
Responses come in request order, so a client may pipeline requests on one connection.
After a BAD_REQUEST (malformed frame) or a refused WRITE the server closes the connection,
because it cannot know where the next frame starts.

CONNECT_QP (the RDMA queue-pair handshake): segment id empty, offset 0, length =
``QP_INFO.size``, followed by the client's ``QP_INFO`` (``!II16sB3x``: QP number, starting PSN,
GID as 16 raw bytes, path MTU as the verbs enum 1..5 = 256..4096 bytes). The node creates an RC
queue pair, brings it to ready-to-receive with the client's values, and answers OK with its
own ``QP_INFO``; or UNSUPPORTED (no RDMA device) with a message, keeping the connection. The
node's queue pair lives as long as that tcp connection: the client keeps it open (its EOF also
tells the client that the node died), and closing it tears the queue pair down.
"""

from __future__ import annotations

import struct
from enum import IntEnum

MAGIC = b"KVP1"
REQUEST = struct.Struct("!4sBxHQQ")
RESPONSE = struct.Struct("!B3xQ")
MAX_SEGMENT_ID_BYTES = 1024
# shm hand-off over the node's unix socket: this header + segment id; the reply is a RESPONSE
# (OK with the segment size as its length, and the segment's fd attached) or an error.
HANDOFF_REQUEST = struct.Struct("!H")
MAX_ERROR_BYTES = 4096


class Op(IntEnum):
    READ = 1
    WRITE = 2
    CONNECT_QP = 3


class FrameStatus(IntEnum):
    OK = 0
    BAD_REQUEST = 1        # malformed frame: bad magic, unknown op, oversized segment id
    OUT_OF_BOUNDS = 2      # offset/length outside the segment
    UNKNOWN_SEGMENT = 3    # no such segment mounted on this node
    UNSUPPORTED = 4        # a valid request this node cannot serve (CONNECT_QP without RDMA)


QP_INFO = struct.Struct("!II16sB3x")


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


def encode_request(op: Op, segment_id: str, offset: int, length: int) -> bytes:
    sid = segment_id.encode()
    return REQUEST.pack(MAGIC, op, len(sid), offset, length) + sid


def encode_response(status: FrameStatus, payload_length: int) -> bytes:
    return RESPONSE.pack(status, payload_length)
