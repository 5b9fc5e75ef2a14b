"""The tcp data-port framing shared by a store node's data server and the tcp transport.

Request:  header ``!4sBxHQQ`` = magic b"KVP1", op, pad, segment id length, offset, length;
          then the segment id (utf-8); then, for WRITE, ``length`` payload bytes.
Response: header ``!B3xQ`` = status, pad, payload length; then the payload: the bytes read
          (READ, status OK) or a utf-8 error message (status != OK).
Responses come in request order, so a client may pipeline requests on one connection.
After a BAD_REQUEST (malformed frame) or a refused WRITE the server closes the connection,
because it cannot know where the next frame starts.
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


class FrameStatus(IntEnum):
    OK = 0
    BAD_REQUEST = 1        # malformed frame: bad magic, unknown op, oversized segment id
    OUT_OF_BOUNDS = 2      # offset/length outside the segment
    UNKNOWN_SEGMENT = 3    # no such segment mounted on this node


def encode_request(op: Op, segment_id: str, offset: int, length: int) -> bytes:
    sid = segment_id.encode()
    return REQUEST.pack(MAGIC, op, len(sid), offset, length) + sid


def encode_response(status: FrameStatus, payload_length: int) -> bytes:
    return RESPONSE.pack(status, payload_length)
