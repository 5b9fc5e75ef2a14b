"""Blocking socket helpers for both ends of kvpool's own wire protocols (data port, shm
hand-off, lookup port)."""

from __future__ import annotations

import socket
from collections.abc import Sequence

from kvpool.common.errors import TransportError


class PeerClosed(TransportError):
    """The peer closed the connection before a whole message arrived."""

    def __init__(self, message: str, received: int) -> None:
        super().__init__(message)
        self.received = received   # bytes of the message that did arrive


def recv_exact_into(sock: socket.socket, view: memoryview, what: str = "node") -> None:
    """Fill ``view`` from ``sock``; PeerClosed if the peer closes first."""
    got, size = 0, len(view)
    while got < size:
        n = sock.recv_into(view[got:], size - got)
        if n == 0:
            raise PeerClosed(f"{what} closed the connection", got)
        got += n


def recv_exact(sock: socket.socket, size: int, what: str = "node") -> bytes:
    buf = bytearray(size)
    recv_exact_into(sock, memoryview(buf), what)
    return bytes(buf)


def send_all(sock: socket.socket, buffers: Sequence[memoryview | bytes]) -> None:
    """sendmsg (scatter-gather, no joining copy) until every buffer is sent."""
    views = [memoryview(b) for b in buffers if len(b)]
    while views:
        sent = sock.sendmsg(views)
        while sent:
            head = views[0]
            if sent >= head.nbytes:
                sent -= head.nbytes
                views.pop(0)
            else:
                views[0] = head[sent:]
                sent = 0
