"""net/sockets.py FrameReader: a socket's frames read through a small buffer give back exactly
the bytes sent, in order, however the sender cut them and the reader asks for them; a read
the buffer's size or more goes straight to its destination; a peer that closes mid-read is
told with how much arrived; and a Spinner sees bytes the reader holds as readable."""

from __future__ import annotations

import os
import socket
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvpool.net.sockets import FrameReader, PeerClosed, Spinner

BUFFER = 64   # small, so that reads cross it often


def _send_in_pieces(sock: socket.socket, data: bytes, cuts: list[int]) -> threading.Thread:
    def send() -> None:
        at = 0
        for cut in [*cuts, len(data)]:
            sock.sendall(data[at:max(at, cut)])
            at = max(at, cut)
    thread = threading.Thread(target=send)
    thread.start()
    return thread


@settings(max_examples=200, deadline=None)
@given(data=st.binary(min_size=1, max_size=2000),
       cuts=st.lists(st.integers(0, 2000), max_size=8).map(sorted),
       reads=st.lists(st.integers(1, 300), min_size=1, max_size=40),
       into=st.lists(st.booleans(), min_size=40, max_size=40))
def test_reads_give_back_the_bytes_sent_whatever_the_cuts(data, cuts, reads, into):
    a, b = socket.socketpair()
    try:
        reader = FrameReader(b, BUFFER)
        sender = _send_in_pieces(a, data, cuts)
        got, at = bytearray(), 0
        for n, as_view in zip(reads, into):
            n = min(n, len(data) - at)
            if n == 0:
                break
            if as_view:
                buf = bytearray(n)
                reader.read_into(memoryview(buf))
                got += buf
            else:
                got += reader.read(n)
            at += n
        sender.join()
        assert bytes(got) == data[:at]
        assert reader.pending() + at <= len(data)
    finally:
        a.close()
        b.close()


def test_a_large_read_goes_straight_to_its_destination(pair):
    a, b = pair
    reader = FrameReader(b, BUFFER)
    head, payload = b"H" * 8, os.urandom(BUFFER * 10)
    a.sendall(head + payload + b"next")
    assert reader.read(8) == head
    left = reader.pending()
    assert 0 < left <= BUFFER - 8   # the rest of the buffer's first read
    out = bytearray(len(payload))
    reader.read_into(memoryview(out))
    assert bytes(out) == payload
    assert reader.pending() == 0   # the payload's tail went past the buffer, not through it
    assert reader.read(4) == b"next"


def test_a_peer_closing_mid_read_is_told_with_what_arrived(pair):
    a, b = pair
    reader = FrameReader(b, BUFFER)
    a.sendall(b"x" * 10)
    a.close()
    with pytest.raises(PeerClosed) as caught:
        reader.read_into(memoryview(bytearray(20)), "client")
    assert caught.value.received == 10
    assert "client closed" in str(caught.value)


def test_bytes_the_reader_holds_count_as_readable(pair):
    a, b = pair
    reader = FrameReader(b, BUFFER)
    spinner = Spinner(b, 0.0, reader=reader)   # no polling: only what is held answers
    a.sendall(b"one" + b"two")
    assert reader.read(3) == b"one"   # "two" came in the same read, and waits in the buffer
    assert reader.pending() == 3
    assert spinner.wait() is True
    assert spinner.readable_within(0) is True
    assert reader.read(3) == b"two"
    assert spinner.readable_within(0) is False


def test_before_wait_runs_before_each_read_of_the_socket_only(pair):
    """A server holds answers back while requests are buffered, and sends them before it
    could wait for the client (else both would wait on each other)."""
    a, b = pair
    waits = []
    reader = FrameReader(b, BUFFER, before_wait=lambda: waits.append(reader.pending()))
    a.sendall(b"0123456789")
    assert reader.read(4) == b"0123" and waits == [0]
    assert reader.read(6) == b"456789" and waits == [0]   # from the buffer: no wait
    a.sendall(b"ab")
    assert reader.read(2) == b"ab" and waits == [0, 0]
