"""The Segment contract over every kind of segment: send_to / recv_from (the tcp data port's
I/O) as each kind implements them, and Segment's defaults run on each host-addressable kind,
so a default is exercised for real even where a kind overrides it."""

from __future__ import annotations

import os
import socket
import struct
import threading
from functools import partial
from types import SimpleNamespace

import pytest
from kvpool.net.sockets import recv_exact, recv_exact_into
from kvpool.store_node.disk import DiskSegment
from kvpool.store_node.hbm import HbmSegment, hbm_unavailable_reason
from kvpool.store_node.memory import Segment, create_dram_segment

SIZE = 1 << 20


NO_GPU = hbm_unavailable_reason(0)


# Segment's defaults go through a host view, which device memory (hbm) has not. hbm runs on
# torch's CPU device (the same calls) and, where there is one, on a GPU.
@pytest.fixture(params=["dram-own", "dram-default", "disk-own", "disk-default", "hbm-own-cpu",
                        pytest.param("hbm-own-cuda:0", marks=[pytest.mark.gpu, pytest.mark.skipif(
                            bool(NO_GPU), reason=f"gpu: {NO_GPU}")])])
def segment_io(request, tmp_path):
    """A segment of each kind, and its own send_to / recv_from or Segment's defaults on it."""
    kind, impl, *device = request.param.split("-")
    if kind == "dram":
        seg = create_dram_segment("n1", 0, SIZE)
    elif kind == "disk":
        seg = DiskSegment("n1/1-test", SIZE, tmp_path / "segment")
    else:
        pytest.importorskip("torch")
        seg = HbmSegment("n1/2-test", SIZE, device[0])
    yield seg, seg if impl == "own" else SimpleNamespace(
        send_to=partial(Segment.send_to, seg), recv_from=partial(Segment.recv_from, seg))
    seg.close()


@pytest.fixture
def pair():
    """The segment's end (blocking, as the data server's are: sendfile needs it) and the
    peer's; a short send or receive fails the test in 10 s instead of hanging it."""
    ours, theirs = socket.socketpair()
    with ours, theirs:
        for option in (socket.SO_RCVTIMEO, socket.SO_SNDTIMEO):
            ours.setsockopt(socket.SOL_SOCKET, option, struct.pack("ll", 10, 0))
        theirs.settimeout(10)
        yield ours, theirs


def test_recv_from_then_send_to_move_the_bytes(segment_io, pair):
    segment, io = segment_io
    ours, theirs = pair
    data = os.urandom(300_001)
    sender = threading.Thread(target=theirs.sendall, args=(data,))
    sender.start()
    io.recv_from(lambda view: recv_exact_into(ours, view), 4096, len(data))
    sender.join()
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(recv_exact(theirs, 5 + len(data))))
    reader.start()
    io.send_to(ours, 4096, len(data), b"head:")
    reader.join()
    assert got == [b"head:" + data]
    back = bytearray(len(data))
    segment.read_into(4096, memoryview(back))   # what the node itself sees
    assert back == data


def test_out_of_range_or_closed_moves_nothing(segment_io, pair):
    segment, io = segment_io
    ours, theirs = pair

    def never(view):
        raise AssertionError("recv_from received for a refused range")

    for offset, length in ((SIZE - 10, 11), (SIZE + 1, 0)):
        with pytest.raises(ValueError):
            io.send_to(ours, offset, length, b"head")
        with pytest.raises(ValueError):
            io.recv_from(never, offset, length)
    segment.close()
    with pytest.raises(ValueError):
        io.send_to(ours, 0, 16, b"head")
    with pytest.raises(ValueError):
        io.recv_from(never, 0, 16)
    theirs.setblocking(False)
    with pytest.raises(BlockingIOError):
        theirs.recv(1)   # not even the header was sent
