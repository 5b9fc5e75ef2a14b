"""A throwaway single-member etcd (Debian's ``etcd-server``) for tests, benchmarks and local HA
clusters: free ports, data in a temporary folder, stopped (and the folder removed) on exit.

    python3 scripts/etcd_server.py [--data-dir DIR]

prints ``etcd: etcd://127.0.0.1:PORT`` once etcd answers and runs until SIGTERM or Ctrl-C (the
HA tests start it so); the scripts beside it import ``EtcdServer``.
"""

from __future__ import annotations

import argparse
import shutil
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Self

from kvpool.tools.cluster import ClusterError, _die_with_parent, die_with_launcher, wait_for_signal

READY_TIMEOUT_S = 20.0


def etcd_binary() -> str | None:
    """The etcd executable on PATH, or None (install Debian's ``etcd-server``)."""
    return shutil.which("etcd")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EtcdServer:
    """``with EtcdServer() as etcd: etcd.url`` -> ``etcd://127.0.0.1:PORT``. With
    ``credentials_dir`` (a kvpool CA's folder, common/pki.py): etcd serves TLS with a
    certificate of that CA and requires every client's (``etcds://127.0.0.1:PORT``)."""

    def __init__(self, data_dir: str | Path | None = None,
                 credentials_dir: str | Path | None = None):
        binary = etcd_binary()
        if binary is None:
            raise ClusterError("etcd is not installed (apt-get install etcd-server)")
        self._binary = binary
        self._own_dir = data_dir is None
        self.data_dir = Path(data_dir or tempfile.mkdtemp(prefix="kvpool-etcd-"))
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.port = 0
        self.proc: subprocess.Popen | None = None
        self._tls: list[str] = []
        self._ssl = None
        if credentials_dir is not None:
            from kvpool.common import pki, security
            creds = security.load(pki.issue(credentials_dir, "etcd", "etcd",
                                            hosts=("127.0.0.1",)))
            self._tls = ["--cert-file", creds.cert_file, "--key-file", creds.key_file,
                         "--trusted-ca-file", creds.ca_file, "--client-cert-auth"]
            self._ssl = ssl.create_default_context(cafile=creds.ca_file)
            self._ssl.load_cert_chain(creds.cert_file, creds.key_file)

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"{'etcds' if self._tls else 'etcd'}://{self.endpoint}"

    def start(self) -> str:
        """Start etcd and wait until it answers; return its ``etcd://`` URL."""
        self.port, peer = _free_port(), _free_port()
        scheme = "https" if self._tls else "http"
        client_url, peer_url = f"{scheme}://127.0.0.1:{self.port}", f"http://127.0.0.1:{peer}"
        # The child holds its own copy of the descriptor; ours is closed once it is spawned.
        with open(self.data_dir / "etcd.log", "ab") as log:
            self.proc = subprocess.Popen(
                [self._binary, "--name", "kvpool-test", "--data-dir", str(self.data_dir / "data"),
                 "--listen-client-urls", client_url, "--advertise-client-urls", client_url,
                 "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
                 "--initial-cluster", f"kvpool-test={peer_url}", "--log-level", "warn",
                 *self._tls],
                stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True,
                preexec_fn=_die_with_parent)  # noqa: PLW1509 - sets PDEATHSIG; fork-safe
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                from urllib.request import urlopen
                with urlopen(f"{client_url}/health", timeout=1.0, context=self._ssl) as r:
                    if b'"true"' in r.read():
                        return self.url
            except OSError:
                pass
            time.sleep(0.1)
        tail = (self.data_dir / "etcd.log").read_text(errors="replace").splitlines()[-10:]
        self.stop()
        raise ClusterError("etcd did not start\n--- log tail ---\n" + "\n".join(tail))

    def stop(self) -> None:
        """Stop etcd and remove its data (when the folder is ours). Idempotent."""
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.terminate()
                try:
                    self.proc.wait(10)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
            self.proc = None
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 scripts/etcd_server.py",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", metavar="DIR",
                   help="keep etcd's data and log here (default: a temporary folder, removed)")
    p.add_argument("--credentials-dir", metavar="DIR",
                   help="a kvpool CA's folder (common/pki.py): serve TLS with a certificate of "
                        "that CA and require clients' (etcds://)")
    args = p.parse_args(argv)
    die_with_launcher()   # started by a test's Proc: end with the test, however it ends
    try:
        with EtcdServer(args.data_dir, args.credentials_dir) as etcd:
            print(f"etcd: {etcd.url}", flush=True)
            wait_for_signal()
    except ClusterError as e:
        print(f"etcd_server: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
