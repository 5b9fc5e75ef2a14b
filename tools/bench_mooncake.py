"""Mooncake Store as a ``kvpool bench`` peer (``--peers mooncake``): its TCP transport between
two processes on this host, as kvpool's tcp figures are measured.

Three processes: ``mooncake_master`` (with its built-in HTTP metadata server, so no etcd), a
holder that mounts the only global segment (so every value lives in another process than the
bench), and the bench itself: a client with no segment that puts and gets through buffers it
registered (``batch_put_from`` / ``batch_get_into``, Mooncake's zero-copy batch calls, its
fastest here; ``put_batch`` / ``get_batch`` with bytes reached about 0.2 x raw tcp on gets).

The recipe, found on this kind of machine with mooncake-transfer-engine-non-cuda 0.3.13:
``MC_TCP_BIND_ADDRESS=127.0.0.1`` (else each client advertises its first non-loopback address),
``MC_STORE_MEMCPY=0`` (it turns itself on where there is no RDMA; no same-host shortcut was
seen, the loopback counters grew by the payload, but a tcp figure must not take one),
``MC_LOG_LEVEL=WARNING`` (clients ignore glog's variables). Removals are forced: Mooncake leases
each read object for 10 s.

``MooncakePeer(local=True)`` is Mooncake's same-host path, the peer of kvpool's shm figures:
no holder; the bench's own client mounts the only global segment (``global_segment_size`` > 0)
with ``MC_STORE_MEMCPY=1``, so every value lives in the bench process. Read in Mooncake's
sources (mooncake-store/src/transfer_task.cpp, v0.3.12.post1 and main as of 2026-08):
``TransferSubmitter::selectStrategy`` picks ``LOCAL_MEMCPY`` when memcpy is enabled
(MC_STORE_MEMCPY, which defaults to on for a tcp-only engine) and the replica's buffer
descriptor names this client's own transport endpoint (``isLocalTransfer`` /
``isSameProcessEndpoint``: the same *process*, not merely the same host, since the address is
a virtual one); the copy is then a memcpy by its worker pool, with no transfer engine call.
What remains per call is its master's RPCs (PutStart/PutEnd, GetReplicaList) over loopback.
A segment in another process on the same host is not local to Mooncake: it goes over tcp.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Self

import numpy as np
from kvpool.tools.bench_peers import PeerUnavailable, _free_port, _spawn, _stop

MOONCAKE_ENV = {"MC_TCP_BIND_ADDRESS": "127.0.0.1", "MC_STORE_MEMCPY": "0",
                "MC_LOG_LEVEL": "WARNING", "GLOG_minloglevel": "1"}
_HOST = "127.0.0.1"
_START_TIMEOUT_S = 30.0
_START_TRIES = 3
_READY = "kvpool: holder ready"
_LOCAL_BUFFER_BYTES = 16 << 20   # staging for unregistered buffers; ours are registered
_INSTALL = ("pip install mooncake-transfer-engine-non-cuda (Linux x86-64; it is in "
            "kvpool[bench])")
# Run by why_unavailable() in a child process: says, after the marker in argv[1] (on a line of
# its own: the library may print too), why the import failed, if it did.
_PROBE_SAYS = "kvpool-probe: "
_IMPORT_PROBE = """
import sys
try:
    from mooncake.store import MooncakeDistributedStore
except ModuleNotFoundError as e:
    ours = (e.name or "").split(".")[0] == "mooncake"
    print(sys.argv[1] + ("missing" if ours else f"ImportError: {e}"))
except (ImportError, OSError) as e:
    print(sys.argv[1] + f"{type(e).__name__}: {e}")
"""


def why_unavailable() -> str:
    """Why Mooncake Store cannot run here, or ``''`` when it can. Its module is imported for
    real, in a child process: an installed package whose native library does not load (e.g.
    ``libibverbs.so.1`` is missing) is unavailable too, and a library that crashes or hangs as
    it loads takes the child down, not the caller. Both the bench and its tests ask this."""
    try:
        probe = subprocess.run([sys.executable, "-c", _IMPORT_PROBE, _PROBE_SAYS],
                               capture_output=True, text=True, timeout=_START_TIMEOUT_S,
                               check=False, env={**MOONCAKE_ENV, **os.environ})
    except subprocess.TimeoutExpired:
        return f"importing mooncake.store took over {_START_TIMEOUT_S:.0f} s"
    said = [line[len(_PROBE_SAYS):] for line in probe.stdout.splitlines()
            if line.startswith(_PROBE_SAYS)]
    if said == ["missing"]:
        return f"Mooncake is not installed ({_INSTALL})"
    if said:
        return f"Mooncake is installed but cannot load: {said[-1]}"
    if probe.returncode != 0:
        tail = probe.stderr.strip()[-400:] or "no output"
        return f"importing mooncake.store failed (exit code {probe.returncode}): {tail}"
    return ""


class MooncakePeer:
    """A private Mooncake Store (master + a holder of ``segment_bytes``) and a client of it;
    ``local``: no holder, the client mounts the segment itself (the same-host path above).

    ``put(keys, rows)`` / ``get(keys, rows)`` move the rows of a registered 2-D array
    (:meth:`register`), one value per row; ``delete(keys)`` removes them."""

    def __init__(self, segment_bytes: int, local: bool = False) -> None:
        self.segment_bytes = segment_bytes
        self.local = local
        self.transport = "local" if local else "tcp"   # the figures' transport column
        self._master = self._holder = None
        self._store = None
        self._registered: list[int] = []
        self._logs: tempfile.TemporaryDirectory | None = None

    def __enter__(self) -> Self:
        why = why_unavailable()
        if why:
            raise PeerUnavailable(why)
        for name, value in MOONCAKE_ENV.items():   # read when the library loads
            os.environ.setdefault(name, value)
        from mooncake.store import MooncakeDistributedStore
        self._logs = tempfile.TemporaryDirectory(prefix="kvpool-bench-mooncake-")
        logs = Path(self._logs.name)
        try:
            metadata, master = self._start_servers(logs)
            self._store = MooncakeDistributedStore()
            # MC_STORE_MEMCPY is read as the client is set up (its transfer submitter is
            # built): on for the local client only, whatever the tcp one was given.
            memcpy = os.environ.get("MC_STORE_MEMCPY")
            os.environ["MC_STORE_MEMCPY"] = "1" if self.local else (memcpy or "0")
            try:
                rc = self._store.setup(_HOST, metadata,
                                       self.segment_bytes if self.local else 0,
                                       _LOCAL_BUFFER_BYTES, "tcp", "", master)
            finally:
                if memcpy is None:
                    del os.environ["MC_STORE_MEMCPY"]
                else:
                    os.environ["MC_STORE_MEMCPY"] = memcpy
            if rc != 0:
                raise PeerUnavailable(f"Mooncake client setup failed (code {rc})")
        except BaseException:
            self.close()
            raise
        return self

    def _start_servers(self, logs: Path) -> tuple[str, str]:
        """Start the master (and the holder) on fresh ports: ``(metadata URL, master address)``.
        A start that fails is tried again on new ports, up to ``_START_TRIES`` times: the free
        ports are picked before the master binds them (another process can take one first), and
        under load Mooncake's client has been seen to give up on a master that did answer its
        port (CI, stop 27: "Client not available" for 30 s)."""
        for attempt in range(1, _START_TRIES + 1):
            rpc, http = _free_port(), _free_port()
            metadata = f"http://{_HOST}:{http}/metadata"
            master = f"{_HOST}:{rpc}"
            try:
                self._master = _spawn([
                    # The package's own launcher: it execs the mooncake_master binary it ships,
                    # wherever pip put the scripts (beside python3 or not, e.g. /usr/local/bin).
                    sys.executable, "-m", "mooncake.cli", f"--rpc_port={rpc}",
                    f"--rpc_address={_HOST}", "--enable_http_metadata_server=true",
                    f"--http_metadata_server_host={_HOST}", f"--http_metadata_server_port={http}",
                    f"--metrics_port={_free_port()}", "--enable_metric_reporting=false",
                    "--rpc_thread_num=2"],
                    log=(logs / "master.log").open("wb"))
                _wait_for_ports(self._master, [rpc, http], logs / "master.log")
                if not self.local:
                    self._holder = _spawn([sys.executable, "-m", "kvpool.tools.bench_mooncake",
                                           "holder", metadata, master, str(self.segment_bytes)],
                                          log=(logs / "holder.log").open("wb"))
                    _wait_for_line(self._holder, logs / "holder.log", _READY)
                return metadata, master
            except PeerUnavailable as e:
                master_said = "mooncake_master " + _said(self._master, logs / "master.log")
                _stop(self._holder)
                _stop(self._master)
                self._holder = self._master = None
                if attempt == _START_TRIES:
                    raise PeerUnavailable(f"{e} (tried {attempt} times; {master_said})") from None
                print(f"[bench {time.strftime('%H:%M:%S')}] Mooncake did not start (try {attempt} "
                      f"of {_START_TRIES}): {str(e)[-200:]}; trying again on new ports",
                      file=sys.stderr, flush=True)
        raise AssertionError("unreachable")

    def __exit__(self, *exc: object) -> None:
        self.close()

    def register(self, array: np.ndarray) -> None:
        """Register ``array`` (C-contiguous) for zero-copy puts and gets."""
        rc = self._store.register_buffer(array.ctypes.data, array.nbytes)
        if rc != 0:
            raise PeerUnavailable(f"Mooncake register_buffer failed (code {rc})")
        self._registered.append(array.ctypes.data)

    def unregister_all(self) -> None:
        for address in self._registered:
            self._store.unregister_buffer(address)
        self._registered.clear()

    def put(self, keys: list[str], rows: np.ndarray) -> list[int]:
        """Per key 0 or Mooncake's (negative) error code."""
        return self._store.batch_put_from(keys, _row_addresses(rows), [rows.shape[1]] * len(keys))

    def get(self, keys: list[str], rows: np.ndarray) -> list[int]:
        """Per key the bytes read, or Mooncake's (negative) error code."""
        return self._store.batch_get_into(keys, _row_addresses(rows), [rows.shape[1]] * len(keys))

    def delete(self, keys: list[str]) -> None:
        self._store.batch_remove(keys, True)

    def close(self) -> None:
        if self._store is not None:
            self.unregister_all()
            self._store.close()
            self._store = None
        _stop(self._holder)
        _stop(self._master)
        self._holder = self._master = None
        if self._logs is not None:
            self._logs.cleanup()
            self._logs = None


def _row_addresses(rows: np.ndarray) -> list[int]:
    return (rows.ctypes.data + np.arange(len(rows), dtype=np.uint64)
            * np.uint64(rows.strides[0])).tolist()


def _wait_for_ports(proc, ports: list[int], log: Path) -> None:
    deadline = time.monotonic() + _START_TIMEOUT_S
    for port in ports:
        while True:
            try:
                socket.create_connection((_HOST, port), timeout=0.5).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise PeerUnavailable(_failed("mooncake_master", proc, log)) from None
                time.sleep(0.1)


def _wait_for_line(proc, log: Path, line: str) -> None:
    deadline = time.monotonic() + _START_TIMEOUT_S
    while proc.poll() is None and time.monotonic() < deadline:
        if line in log.read_text(errors="replace"):
            return
        time.sleep(0.05)
    raise PeerUnavailable(_failed("the Mooncake holder", proc, log))


def _failed(name: str, proc, log: Path) -> str:
    return f"{name} did not start {_said(proc, log)}"


def _said(proc, log: Path) -> str:
    """``(exit code N): the log's tail``; N is None while the process runs."""
    tail = log.read_text(errors="replace").strip()[-400:] if log.exists() else ""
    code = proc.poll() if proc is not None else None
    return f"(exit code {code}): {tail or 'no output'}"


def _hold(metadata: str, master: str, segment_bytes: int) -> int:
    """The holder process: mount ``segment_bytes`` until SIGTERM."""
    for name, value in MOONCAKE_ENV.items():
        os.environ.setdefault(name, value)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    from mooncake.store import MooncakeDistributedStore
    store = MooncakeDistributedStore()
    if store.setup(_HOST, metadata, segment_bytes, _LOCAL_BUFFER_BYTES, "tcp", "", master) != 0:
        print("holder setup failed", flush=True)
        return 1
    print(_READY, flush=True)
    signal.sigwait({signal.SIGTERM, signal.SIGINT})
    store.close()
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "holder":
        sys.exit(_hold(sys.argv[2], sys.argv[3], int(sys.argv[4])))
    sys.exit("usage: python -m kvpool.tools.bench_mooncake holder METADATA_URL MASTER BYTES")
