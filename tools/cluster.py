"""A local cluster of real processes: one master and N store nodes on one host.

Used by ``kvpool up`` and ``kvpool demo``, and by the integration tests, so the cluster a user
starts with one command is the one the tests exercise.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Self

READY_TIMEOUT_S = 30.0
_PR_SET_PDEATHSIG = 1
# Resolved here, not in the child: between fork and exec only async-signal-safe work is safe
# (the launcher may already run gRPC threads), and dlopen is not.
_prctl = ctypes.CDLL(None, use_errno=True).prctl


# A kvpool child started by Proc finds this set and asks the kernel to end it with its parent
# (die_with_launcher). Not done in a preexec_fn: that forces a fork(), whose atfork handlers in
# a launcher with live gRPC channels can block for good (seen: a test hung in restart_master);
# without one, subprocess uses vfork, which runs no handlers.
_DIE_WITH_PARENT_ENV = "KVPOOL_DIE_WITH_PARENT"
_ORPHAN_POLL_S = 0.2
_ORPHAN_GRACE_S = 3.0


def _die_with_parent() -> None:
    # Children must not outlive a launcher that is SIGKILLed (a crashed test, a killed shell).
    _prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM))


def die_with_launcher() -> None:
    """In a kvpool process: if Proc started it, end with the process that did: SIGTERM (a
    clean stop) when the launcher dies, and an exit ``_ORPHAN_GRACE_S`` later if the clean
    stop has not ended the process. The kernel's PDEATHSIG sends the SIGTERM, and a watcher
    thread sends it too once the parent pid changes: in a CI run under load a node of a
    killed launcher got no signal and ran on, idle, 35 minutes later."""
    if os.environ.pop(_DIE_WITH_PARENT_ENV, None):
        _die_with_parent()
        launcher = os.getppid()

        def watch() -> None:
            while os.getppid() == launcher:
                time.sleep(_ORPHAN_POLL_S)
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(_ORPHAN_GRACE_S)
            os._exit(1)
        threading.Thread(target=watch, name="kvpool-orphan-watch", daemon=True).start()


def wait_for_signal() -> None:
    """Block until SIGINT or SIGTERM: how a command that runs until Ctrl-C waits."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()


class ClusterError(RuntimeError):
    """A cluster process failed to start; the message carries the tail of its log."""


class Proc:
    """One child process whose stdout announces readiness with a ``name: value`` line."""

    def __init__(self, name: str, argv: Sequence[str], log: IO[bytes] | None,
                 launcher: Sequence[str] = (), program: Sequence[str] = ()):
        """``launcher``: a command that runs the kvpool one, e.g. ``ip netns exec NS``.
        ``program``: what ``argv`` is given to, if not ``python -m kvpool`` (a script)."""
        self.name = name
        self.log = log
        self.ready = ""   # what the readiness line said, once wait_ready returned
        self.popen = subprocess.Popen(
            [*launcher, *(program or (sys.executable, "-m", "kvpool")), *argv],
            stdout=subprocess.PIPE,
            stderr=log if log is not None else None, stdin=subprocess.DEVNULL,
            env={**os.environ, _DIE_WITH_PARENT_ENV: "1"},
            # Ctrl-C in a terminal reaches only us, and we stop the children in order.
            start_new_session=True)

    def wait_ready(self, prefix: str, timeout_s: float = READY_TIMEOUT_S) -> str:
        """Block until the child prints ``prefix: VALUE``; return VALUE."""
        deadline = time.monotonic() + timeout_s
        assert self.popen.stdout is not None
        while time.monotonic() < deadline:
            line = self.popen.stdout.readline().decode(errors="replace")
            if not line:
                break
            if line.startswith(prefix + ":"):
                self.ready = line.split(":", 1)[1].strip()
                return self.ready
        self.kill()
        raise ClusterError(f"{self.name} did not start (exit code {self.popen.poll()})"
                           + self._log_tail())

    def _log_tail(self) -> str:
        if self.log is None or not hasattr(self.log, "name"):
            return ""
        tail = Path(self.log.name).read_text(errors="replace").splitlines()[-15:]
        return "\n--- log tail ---\n" + "\n".join(tail)

    def alive(self) -> bool:
        return self.popen.poll() is None

    def terminate(self, timeout_s: float = 10.0) -> int:
        """SIGTERM, wait, SIGKILL if it will not go. Returns the exit code."""
        if self.alive():
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        if self.popen.stdout:
            self.popen.stdout.close()
        return self.popen.wait()

    def kill(self) -> None:
        if self.alive():
            self.popen.kill()
        self.popen.wait()


class LocalCluster:
    """``with LocalCluster(nodes=2) as c: KVClient(c.master)``: real processes, stopped on exit."""

    def __init__(self, nodes: int = 2, segment_size: str = "1GiB", host: str = "127.0.0.1",
                 port: int = 0, master_args: Sequence[str] = (), node_args: Sequence[str] = (),
                 log_dir: str | os.PathLike | None = None, masters: int = 1,
                 ha: str | None = None, disk_size: str | None = None,
                 disk_path: str | os.PathLike | None = None, metrics: bool = False,
                 secure: bool = True, credentials_dir: str | os.PathLike | None = None):
        """``ha``: an ``etcd://`` (or ``etcds://``) URL: run ``masters`` standby masters
        electing on it (on
        free ports); ``master`` is then that URL, which the nodes and clients follow.
        ``disk_size``: give every node a disk tier of that size, in ``disk_path``/NODE (kept:
        a cluster started again on it finds its nodes' objects) or, without ``disk_path``, in
        a temporary directory removed by ``stop``. ``metrics``: every process serves
        /metrics and its probes on a free port (``metrics_addresses``, by process name).
        ``secure`` (the default): the cluster makes its own CA and credentials (common/pki.py)
        in ``credentials_dir`` (default: a temporary directory, removed by ``stop``), serves
        mutual TLS, and registers them for its master address, where this user's clients and
        nodes find them (common/security.py ``resolve``); False: plain text (a loopback
        master), for tests of what an unauthenticated peer meets."""
        if masters > 1 and not ha:
            raise ValueError("several masters need an etcd URL to elect on (ha=)")
        self.n_masters, self.ha = masters, ha
        self.standbys: dict[str, Proc] = {}   # with ha: every master process, by address
        self.n_nodes = nodes
        self.segment_size = segment_size
        self.host, self.port = host, port
        self.master_args, self.node_args = list(master_args), list(node_args)
        self.log_dir = Path(log_dir) if log_dir else None
        self.master = ""
        self.master_proc: Proc | None = None
        self.nodes: list[Proc] = []
        self._logs: list[IO[bytes]] = []
        if disk_path is not None and disk_size is None:
            raise ValueError("a disk path needs a disk size")
        self.disk_size = disk_size
        self.disk_path = Path(disk_path) if disk_path is not None else None
        self._disk_tmp: str | None = None   # created here, removed by stop
        self._metrics = ["--metrics-port", "0"] if metrics else []
        self.secure = secure
        self._creds_dir = Path(credentials_dir) if credentials_dir is not None else None
        self._creds_tmp: str | None = None   # created here, removed by stop
        self._registered: list[str] = []     # addresses whose credentials stop unregisters
        self._master_creds: list[str] = []
        self.metrics_addresses: dict[str, str] = {}

    @property
    def disk_dir(self) -> Path | None:
        """Where the nodes' disk tiers are (one directory per node), None without them."""
        if self.disk_size is None:
            return None
        if self.disk_path is None and self._disk_tmp is None:
            self._disk_tmp = tempfile.mkdtemp(prefix="kvpool-disk-")
        if self.disk_path is not None:
            self.disk_path.mkdir(parents=True, exist_ok=True)
        return self.disk_path or Path(self._disk_tmp)

    @property
    def credentials_dir(self) -> Path | None:
        """Where the cluster's CA and credentials are (None: not secure)."""
        if not self.secure:
            return None
        if self._creds_dir is None:
            self._creds_tmp = tempfile.mkdtemp(prefix="kvpool-credentials-")
            self._creds_dir = Path(self._creds_tmp)
        return self._creds_dir

    @property
    def client_credentials(self) -> Path | None:
        """The default client's credentials file (what ``KVPOOL_CREDENTIALS`` may name)."""
        return self.credentials_dir / "client.yaml" if self.secure else None

    def credentials(self, role: str, name: str) -> Path:
        """A credentials file of this cluster's CA for ``role``/``name`` (issued if new)."""
        from kvpool.common import pki
        return pki.ensure(self.credentials_dir, role, name)

    def _security_args(self) -> list[str]:
        """The master's flags: its credentials, or --insecure off loopback without them."""
        from kvpool.common import security
        if not self.secure:
            return [] if security.is_loopback(self.host) else ["--insecure"]
        if not self._master_creds:
            from kvpool.common import pki
            self._master_creds = ["--credentials",
                                  str(pki.make_local(self.credentials_dir, self.host))]
        return self._master_creds

    def _register(self, *addresses: str) -> None:
        if self.secure:
            from kvpool.common import security
            security.register(list(addresses), self.credentials_dir)
            self._registered.extend(addresses)

    def _log(self, name: str) -> IO[bytes] | None:
        if self.log_dir is None:
            return None
        self.log_dir.mkdir(parents=True, exist_ok=True)
        f = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 - open for the child's life
        self._logs.append(f)
        return f

    def start(self) -> str:
        """Start the master and every node; return the master's address once all are mounted."""
        try:
            if self.ha:
                for _ in range(self.n_masters):
                    self.add_master()
                self.master = self.ha
                self._register(self.ha)
                self.leader()
            else:
                self.master_proc = Proc("master", ["master", "--host", self.host, "--port",
                                                   str(self.port), *self._metrics,
                                                   *self._security_args(),
                                                   *self.master_args], self._log("master"))
                self.master = self.master_proc.wait_ready("master")
                self._register(self.master)
                self._note_metrics(self.master_proc)
            for i in range(self.n_nodes):
                self.add_node(f"node{i}")
        except BaseException:
            self.stop()
            raise
        return self.master

    def _note_metrics(self, proc: Proc) -> None:
        if self._metrics:
            self.metrics_addresses[proc.name] = proc.wait_ready("metrics")

    def kill_master(self) -> None:
        """SIGKILL the master (a crash: no clean shutdown); the nodes keep running."""
        if self.master_proc:
            self.master_proc.kill()
            if self.master_proc.popen.stdout:
                self.master_proc.popen.stdout.close()

    def restart_master(self) -> str:
        """Kill the master (SIGKILL) if it runs, and start a new one, with an empty index, on
        the same address; returns once it serves. The nodes re-announce what they hold."""
        self.kill_master()
        _, _, port = self.master.rpartition(":")
        self.master_proc = Proc("master", ["master", "--host", self.host, "--port", port,
                                           *self._metrics, *self._security_args(),
                                           *self.master_args],
                                self._log("master"))
        address = self.master_proc.wait_ready("master")
        assert address == self.master, (address, self.master)
        self._note_metrics(self.master_proc)
        return address

    def add_master(self) -> str:
        """With ``ha``: start one more master (a standby unless none leads); its address."""
        name = f"master{len(self.standbys)}"
        proc = Proc(name, ["master", "--host", self.host, "--port", "0", "--ha", str(self.ha),
                           *self._metrics, *self._security_args(), *self.master_args],
                    self._log(name))
        address = proc.wait_ready("master")
        self._register(address)
        self._note_metrics(proc)
        self.standbys[address] = proc
        return address

    def leader(self, timeout_s: float = READY_TIMEOUT_S) -> str:
        """With ``ha``: the address of the master that leads now, once one does."""
        from kvpool.common.addresses import parse_etcd_url
        from kvpool.rpc.leader import read_leader
        url = parse_etcd_url(str(self.ha))
        creds = None
        if url.tls:
            from kvpool.common import security
            creds = security.load(self.client_credentials)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            address = read_leader(url, 2.0, creds)
            if address in self.standbys and self.standbys[address].alive():
                return address
            time.sleep(0.05)
        raise ClusterError(f"no master was elected leader within {timeout_s:.0f}s")

    def kill_leader(self) -> str:
        """With ``ha``: SIGKILL the leading master; returns its address."""
        address = self.leader()
        proc = self.standbys[address]
        proc.kill()
        if proc.popen.stdout:
            proc.popen.stdout.close()
        return address

    def add_node(self, name: str, extra_args: Sequence[str] = ()) -> Proc:
        """Start one more store node and wait until its segments are mounted."""
        disk: list[str] = []
        if self.disk_dir is not None:
            disk = ["--disk-path", str(self.disk_dir / name), "--disk-size", str(self.disk_size)]
        creds = ["--credentials", str(self.credentials("node", name))] if self.secure else []
        proc = Proc(name, ["store-node", "--master", self.master, "--host", self.host,
                           "--segment-size", self.segment_size, "--node-id", name, *disk,
                           *creds,
                           *self._metrics, *self.node_args, *extra_args], self._log(name))
        self.nodes.append(proc)
        self._note_metrics(proc)   # printed before the node mounts
        proc.wait_ready("store-node")
        return proc

    def stop(self) -> None:
        """Stop nodes first (they unmount), then the master. Idempotent."""
        for proc in reversed(self.nodes):
            proc.terminate()
        if self.master_proc:
            self.master_proc.terminate()
        for proc in self.standbys.values():
            proc.terminate()
        for f in self._logs:
            f.close()
        self._logs.clear()
        if self._disk_tmp is not None:
            shutil.rmtree(self._disk_tmp, ignore_errors=True)
            self._disk_tmp = None
        if self._registered:
            from kvpool.common import security
            security.unregister(self._registered)
            self._registered.clear()
        if self._creds_tmp is not None:
            shutil.rmtree(self._creds_tmp, ignore_errors=True)
            self._creds_tmp = self._creds_dir = None
            self._master_creds = []

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
