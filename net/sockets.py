"""Blocking socket helpers for both ends of kvpool's own wire protocols (data port, shm
hand-off, lookup port)."""

from __future__ import annotations

import math
import os
import select
import socket
import ssl
import time
from collections.abc import Callable, Sequence

from kvpool.common.config import ConfigError
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


class FrameReader:
    """Reads one socket's frames through a small buffer of its own: a frame's header and
    short fields, and as much of what follows as has arrived, come in one system call where
    reading each apart costs one each (a store node's 64 KiB put over tcp: 14 reads, 3 so).
    A read at least the buffer's size, once the buffer is drained, goes straight to its
    destination (a payload lands where it is stored, not copied twice). Every read of the
    socket must go through it; :meth:`pending` tells a poller what it holds unread.
    ``before_wait``: called before each read of the socket, which may wait for the peer (a
    server that holds answers back while more requests are buffered sends them there)."""

    __slots__ = ("sock", "_buf", "_start", "_end", "_before_wait")

    def __init__(self, sock: socket.socket, size: int = 8192,
                 before_wait: Callable[[], object] | None = None) -> None:
        self.sock = sock
        self._buf = memoryview(bytearray(size))
        self._start = self._end = 0
        self._before_wait = before_wait

    def pending(self) -> int:
        """Bytes read from the socket and not yet taken."""
        return self._end - self._start

    def read_into(self, view: memoryview, what: str = "node") -> None:
        """Fill ``view``; PeerClosed if the peer closes first."""
        size, got = len(view), min(len(view), self._end - self._start)
        if got:
            view[:got] = self._buf[self._start:self._start + got]
            self._start += got
        while got < size:
            if self._before_wait is not None:
                self._before_wait()
            if size - got >= len(self._buf):
                n = self.sock.recv_into(view[got:], size - got)
                take = n
            else:
                n = self.sock.recv_into(self._buf, len(self._buf))
                take = min(n, size - got)
                view[got:got + take] = self._buf[:take]
                self._start, self._end = take, n
            if n == 0:
                raise PeerClosed(f"{what} closed the connection", got)
            got += take

    def read(self, size: int, what: str = "node") -> bytes:
        """The next ``size`` bytes; PeerClosed if the peer closes first."""
        start = self._start
        if self._end - start >= size:
            self._start = start + size
            return self._buf[start:start + size].tobytes()
        buf = bytearray(size)
        self.read_into(memoryview(buf), what)
        return bytes(buf)


SPIN_ENV = "KVPOOL_SPIN_US"
_SPIN_DEFAULT_US = 200
_SPIN_MAX_US = 100_000
_MAX_BACKOFF = 6      # after misses in a row, up to 2**6 - 1 waits sleep at once
# A nap for an answer ends this long before the answer is due: a timer's wake-up here comes
# ~75 us late (the kernel's timer slack and the wake-up), and answers come early by some.
_NAP_EARLY_S = 150e-6
# Answers due later than this many spins are not napped for: a wake-up is little of their time,
# and a wrong estimate (the first answer held up by the peer) would cost more.
_NAP_MAX_SPINS = 20


def spin_default_s() -> float:
    """How long a caller waiting for an answer polls before it sleeps: ``$KVPOOL_SPIN_US``
    microseconds (0: never; default 200). See :class:`Spinner`."""
    text = os.environ.get(SPIN_ENV, "").strip()
    if not text:
        return _SPIN_DEFAULT_US / 1e6
    try:
        us = float(text)
    except ValueError:
        us = math.nan
    if not 0 <= us <= _SPIN_MAX_US:
        raise ConfigError(f"${SPIN_ENV}: {text!r} is not a number of microseconds from 0 to "
                          f"{_SPIN_MAX_US}")
    return us / 1e6


class _BackOff:
    """The back-off both spinners share: after spins that caught nothing, ``n`` in a row, the
    next ``2**n - 1`` (up to 63) are skipped; a spin that catches something ends it."""

    __slots__ = ("_misses", "_skip")

    def __init__(self) -> None:
        self._misses = self._skip = 0

    def _skips(self) -> bool:
        """Whether this spin is one the back-off skips (counted off)."""
        if self._skip:
            self._skip -= 1
            return True
        return False

    def _caught(self) -> None:
        self._misses = 0

    def _missed(self) -> None:
        self._misses = min(self._misses + 1, _MAX_BACKOFF)
        self._skip = (1 << self._misses) - 1


class Spinner(_BackOff):
    """Waits for the next answer on one socket by polling, without sleeping, for up to
    ``spin_s`` before the caller's blocking read. Why: a thread that sleeps on an answer
    waits for a wake-up after it arrives, and on a virtual machine that wake-up is most of a
    short round trip (a Python echo over loopback here: 85 us sleeping, 27 us polling; a 64
    KiB get over shm 0.18 ms against 0.14). Each poll releases the GIL and the thread yields
    its CPU between polls, so other threads, and a peer on the same CPU, still run. An answer
    that does not come within ``spin_s`` (a large batch, a busy peer) costs that much CPU
    for nothing: after such misses in a row the next 1, 3, 7, ... 63 waits sleep at once,
    and the first answer that comes in time ends the back-off."""

    __slots__ = ("_pending", "_poller", "_spin_s", "_due", "_asked")

    def __init__(self, sock: socket.socket, spin_s: float | None = None,
                 reader: FrameReader | None = None) -> None:
        super().__init__()
        # Over TLS a frame may be read into the TLS layer already, and through ``reader``
        # into its buffer, where a poll of the socket does not see it: such bytes count as
        # readable.
        tls = sock.pending if isinstance(sock, ssl.SSLSocket) else None
        self._pending = tls if reader is None else reader.pending if tls is None else \
            (lambda: reader.pending() or tls())
        self._poller = select.poll()
        self._poller.register(sock, select.POLLIN)
        self._spin_s = spin_default_s() if spin_s is None else spin_s
        self._due: dict[int, float] = {}   # kind of call -> how long its answers take (s)
        self._asked: tuple[int, float] | None = None   # (kind, when) of a wait that slept

    def wait(self, kind: int | None = None) -> bool:
        """Poll until the socket is readable or the spin ends; whether it is readable (False
        too when this wait sleeps: the caller reads, blocking, as it would without).

        ``kind`` names the call answered (the same kind: answers that take alike), which lets
        the wait learn how long its answers take. An answer due later than the spin (a
        256-key lookup: ~0.8 ms) but within 20 spins is then napped for: the thread sleeps
        on a timer until shortly before the answer is due and polls from there. The timer's
        wake-up falls while the peer still works, where sleeping on the socket puts a wake-up
        (~0.1 ms here) after the answer. Such waits do not back off, as the nap leaves the
        CPU to others. A caller that passes ``kind`` calls :meth:`arrived` after its read."""
        self._asked = None   # a read that failed since never arrived
        if self._pending is not None and self._pending():
            return True
        if not self._spin_s:
            return False
        poll, start = self._poller.poll, time.perf_counter()
        spin_s = self._spin_s
        if kind is None:
            if self._skips():
                return False
        else:
            due = self._due.get(kind, 0.0)
            if self._spin_s < due - _NAP_EARLY_S < self._spin_s * _NAP_MAX_SPINS:
                time.sleep(due - _NAP_EARLY_S)
                if poll(0):   # it came while we slept: nap less next time
                    self._due[kind] = due * 0.9
                    return True
                spin_s += due / 2   # answers spread with their time
        end = time.perf_counter() + spin_s
        while not poll(0):
            if time.perf_counter() >= end:
                if kind is None:
                    self._missed()
                else:
                    self._asked = (kind, start)
                return False
            os.sched_yield()
        if kind is None:
            self._caught()
        else:
            self._learn(kind, time.perf_counter() - start)
        return True

    def arrived(self) -> None:
        """The answer a :meth:`wait` given a ``kind`` slept on has arrived (the caller read
        it): how long it took is learnt."""
        if self._asked is not None:
            kind, start = self._asked
            self._asked = None
            self._learn(kind, time.perf_counter() - start)

    def _learn(self, kind: int, took_s: float) -> None:
        # Later answers move the estimate up slowly and at most by an eighth at a time (one
        # answer held up by a collection must not make the next wait nap for it); earlier ones
        # move it down faster, so that the nap ends before most answers.
        due = self._due.get(kind)
        if due is None:
            self._due[kind] = took_s
        elif took_s > due:
            self._due[kind] = due + min(took_s - due, due) / 8
        else:
            self._due[kind] = due - (due - took_s) / 4

    def readable_within(self, timeout_ms: int) -> bool:
        """Whether the socket becomes readable within ``timeout_ms``, sleeping on it (after
        :meth:`wait`, for a caller that gives up on the socket after a while)."""
        if self._pending is not None and self._pending():
            return True
        return bool(self._poller.poll(timeout_ms))


class LoopSpinner(_BackOff):
    """A server's side of :class:`Spinner`: after each answer its asyncio event loop keeps
    polling for up to ``spin_s`` instead of sleeping in its selector, so that the next
    request of a client making call after call is not met by a sleeping core (on a virtual
    machine, waking it is most of a short round trip). It polls by running: a callback that
    reschedules itself keeps the loop's selector polling without a timeout, so whatever
    arrives (any connection, a timer, another thread's callback) is served at once; the
    callback yields the CPU each time round, so other processes on it still run. A spin that
    ends with no request in it counts as a miss, and misses back off as :class:`Spinner`'s
    do."""

    __slots__ = ("_spin_s", "_until", "_running", "_heard")

    def __init__(self, spin_s: float | None = None) -> None:
        super().__init__()
        self._spin_s = spin_default_s() if spin_s is None else spin_s
        self._until = 0.0
        self._running = self._heard = False

    @property
    def spinning(self) -> bool:
        """Whether the loop is being kept polling now."""
        return self._running

    def heard(self) -> None:
        """A request arrived (it ends a back-off, as an answer caught in time does)."""
        self._heard = True

    def answered(self, loop) -> None:
        """An answer went out: keep ``loop`` polling for up to ``spin_s`` from now."""
        if not self._spin_s or self._skips():
            return
        self._until = max(self._until, time.perf_counter() + self._spin_s)
        if not self._running:
            self._running, self._heard = True, False
            loop.call_soon(self._poll, loop)

    def hold(self, loop, seconds: float) -> None:
        """A client asked (a SPIN frame): keep ``loop`` polling for ``seconds`` from now, back-off
        or not (its call is on the way)."""
        if not self._spin_s:   # $KVPOOL_SPIN_US=0: no polling, asked for or not
            return
        self._until = max(self._until, time.perf_counter() + seconds)
        if not self._running:
            self._running, self._heard = True, False
            loop.call_soon(self._poll, loop)

    def _poll(self, loop) -> None:
        if time.perf_counter() < self._until:
            os.sched_yield()
            loop.call_soon(self._poll, loop)
            return
        self._running = False
        if self._heard:   # a request came within the spin (each answer extends it)
            self._caught()
        else:
            self._missed()


def recv_exact(sock: socket.socket, size: int, what: str = "node") -> bytes:
    buf = bytearray(size)
    recv_exact_into(sock, memoryview(buf), what)
    return bytes(buf)


def send_all(sock: socket.socket, buffers: Sequence[memoryview | bytes]) -> None:
    """sendmsg (scatter-gather, no joining copy) until every buffer is sent; over TLS (no
    sendmsg there) one sendall per buffer."""
    if isinstance(sock, ssl.SSLSocket):
        for b in buffers:
            sock.sendall(b)
        return
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
