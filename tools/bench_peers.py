"""The baselines ``kvpool bench`` measures kvpool against, in the same run, on the same bytes.

- :func:`memcpy_copy`: one numpy copy into a preallocated buffer (the physical limit of shm).
- :class:`RawTCPPeer`: a second process that streams bytes over one loopback TCP connection with
  plain ``sendall`` / ``recv_into`` (the physical limit of any tcp transport written in Python).
- :class:`RedisPeer`: Debian's ``redis-server``, started here with persistence off, driven by
  redis-py (hiredis parser) with pipelines.

Every peer is a context manager that owns the process it starts and stops it on exit, whatever
happened in between.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import IO, Self

import numpy as np
from kvpool.net.sockets import recv_exact_into

_START_TIMEOUT_S = 20.0
# Raw tcp request: op (b"G" = server sends, b"P" = server receives), block count, block bytes.
_RAW_REQUEST = struct.Struct("!cQQ")
_RAW_ACK = b"k"


class PeerUnavailable(RuntimeError):
    """A baseline cannot run here (e.g. redis-server or redis-py is not installed)."""


def memcpy_copy(dst: np.ndarray, src: np.ndarray) -> None:
    """The shm physical limit: one memcpy of the same bytes into a preallocated buffer."""
    np.copyto(dst, src)


def _spawn(argv: Sequence[str], log: IO[bytes] | None = None) -> subprocess.Popen:
    """Start a peer's process; its output to ``log``, else to a pipe (read it, or keep it
    quiet: a full pipe blocks the process)."""
    from kvpool.tools.cluster import _die_with_parent
    return subprocess.Popen(list(argv), stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE if log is None else log,
                            stderr=subprocess.STDOUT, start_new_session=True,
                            preexec_fn=_die_with_parent)  # noqa: PLW1509 - PDEATHSIG, fork-safe


def _stop(proc: subprocess.Popen | None, timeout_s: float = 10.0) -> None:
    if proc is None:
        return
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
    proc.wait()
    if proc.stdout:
        proc.stdout.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- raw loopback tcp


class RawTCPPeer:
    """Raw loopback TCP between two processes: one stream, ``sendall`` and ``recv_into``.

    ``get(dst_rows)`` has the peer send ``len(dst_rows)`` blocks that land in the rows;
    ``put(src_rows)`` sends the rows and waits for the peer's one-byte ack once all arrived.
    """

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self._sock: socket.socket | None = None

    def __enter__(self) -> Self:
        try:
            self.proc = _spawn([sys.executable, "-m", "kvpool.tools.bench_peers", "raw-tcp"])
            line = _ready_line(self.proc, "raw-tcp")
            self._sock = socket.create_connection(("127.0.0.1", int(line)), timeout=60)
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        _stop(self.proc)

    def get(self, rows: Sequence[memoryview]) -> None:
        sock = self._sock
        sock.sendall(_RAW_REQUEST.pack(b"G", len(rows), rows[0].nbytes))
        for row in rows:
            recv_exact_into(sock, row)

    def put(self, rows: Sequence[memoryview]) -> None:
        sock = self._sock
        sock.sendall(_RAW_REQUEST.pack(b"P", len(rows), rows[0].nbytes))
        for row in rows:
            sock.sendall(row)
        recv_exact_into(sock, memoryview(bytearray(1)))


def _serve_raw_tcp() -> None:
    """The raw tcp peer process: print ``raw-tcp: PORT``, serve one connection until EOF."""
    listener = socket.create_server(("127.0.0.1", 0))
    print(f"raw-tcp: {listener.getsockname()[1]}", flush=True)
    conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    header = memoryview(bytearray(_RAW_REQUEST.size))
    buf = bytearray(0)
    try:
        while True:
            recv_exact_into(conn, header)
            op, count, block = _RAW_REQUEST.unpack(header)
            if len(buf) < block:
                buf = bytearray(os.urandom(block))
            view = memoryview(buf)[:block]
            if op == b"G":
                for _ in range(count):
                    conn.sendall(view)
            else:
                for _ in range(count):
                    recv_exact_into(conn, view)
                conn.sendall(_RAW_ACK)
    except OSError:   # the bench closed the connection (PeerClosed is one)
        pass


# ---------------------------------------------------------------- redis


class RedisPeer:
    """A private ``redis-server`` (persistence off, loopback only) and a pipelined client."""

    def __init__(self, executable: str | None = None) -> None:
        self.executable = executable or shutil.which("redis-server")
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self.client = None

    def __enter__(self) -> Self:
        if not self.executable:
            raise PeerUnavailable("redis-server is not installed (Debian: apt-get install "
                                  "redis-server)")
        try:
            import redis
        except ImportError:
            raise PeerUnavailable("redis-py is not installed (pip install 'kvpool[bench]')"
                                  ) from None
        try:
            self.port = _free_port()
            self.proc = _spawn([self.executable, "--port", str(self.port), "--bind", "127.0.0.1",
                                "--save", "", "--appendonly", "no", "--daemonize", "no",
                                "--loglevel", "warning", "--protected-mode", "yes",
                                "--proto-max-bulk-len", "1gb"])
            self.client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=60)
            deadline = time.monotonic() + _START_TIMEOUT_S
            while True:
                try:
                    self.client.ping()
                    break
                except redis.ConnectionError:
                    if self.proc.poll() is not None or time.monotonic() > deadline:
                        raise PeerUnavailable("redis-server did not start: "
                                              + _drain(self.proc)) from None
                    time.sleep(0.05)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def hiredis(self) -> bool:
        from redis.utils import HIREDIS_AVAILABLE
        return bool(HIREDIS_AVAILABLE)

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None
        _stop(self.proc)

    def put(self, keys: Sequence[str], rows: Sequence[memoryview]) -> None:
        pipe = self.client.pipeline(transaction=False)
        for key, row in zip(keys, rows):
            pipe.set(key, row)
        pipe.execute()

    def get(self, keys: Sequence[str]) -> list[bytes]:
        # Generous to Redis: the values are left as the bytes objects redis-py returns, not
        # copied into the caller's buffers as kvpool's get_into does.
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.get(key)
        return pipe.execute()

    def delete(self, keys: Sequence[str]) -> None:
        if keys:
            self.client.delete(*keys)


def _ready_line(proc: subprocess.Popen, prefix: str) -> str:
    deadline = time.monotonic() + _START_TIMEOUT_S
    while time.monotonic() < deadline:
        line = proc.stdout.readline().decode(errors="replace")
        if not line:
            break
        if line.startswith(prefix + ":"):
            return line.split(":", 1)[1].strip()
    raise PeerUnavailable(f"{prefix} peer did not start (exit code {proc.poll()})")


def _drain(proc: subprocess.Popen) -> str:
    if proc.poll() is None:
        return "no answer to PING"
    return proc.stdout.read().decode(errors="replace").strip()[-500:]


if __name__ == "__main__":
    if sys.argv[1:] == ["raw-tcp"]:
        _serve_raw_tcp()
    else:
        sys.exit("usage: python -m kvpool.tools.bench_peers raw-tcp")
