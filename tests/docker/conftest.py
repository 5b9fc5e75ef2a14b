"""The docker tests' machinery: a dockerd of their own in a network namespace
(scripts/docker/dockerd.sh), kvpool's image built on it (deploy/docker/build-image.sh, cached
across runs), and the cleanup of everything they started, however they end.

Where Docker cannot run here (not root, docker.io missing, the data-root on overlayfs as in a
container such as scripts/fresh-machine-check.sh's, dockerd does not start) the tests skip,
saying why; with CI=true they fail instead, since CI is where they must run.

Run them alone: `python3 -m pytest tests/docker` (warm, about 30 s; the first run on a machine
also builds the base image and downloads the wheels, about 2 minutes).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCKERD = REPO / "scripts" / "docker" / "dockerd.sh"
LOCK = Path("/run/lock/kvpool-docker.lock")   # one session at a time owns the daemon
BUILD_TIMEOUT_S = 900     # cold: debootstrap and the wheelhouse downloads; warm: seconds
START_TIMEOUT_S = 60
LOCK_WAIT_S = 600         # for another session's docker tests to end


@dataclass(frozen=True)
class Docker:
    """The running daemon: ``ns_ip`` is where its published ports are reached."""
    ns_ip: str
    env: dict[str, str]      # what a docker or compose command needs (DOCKER_HOST, ...)
    docker: str              # the client binary
    image: str               # kvpool:VERSION
    etcd_image: str          # kvpool-etcd:VERSION

    def run(self, *args: str, timeout_s: float = 120, check: bool = True
            ) -> subprocess.CompletedProcess:
        r = subprocess.run([self.docker, *args], env={**os.environ, **self.env},
                           capture_output=True, text=True, timeout=timeout_s, check=False)
        if check and r.returncode != 0:
            raise AssertionError(f"docker {' '.join(args)}: exit {r.returncode}\n{r.stderr}")
        return r


def unavailable(reason: str):
    """Skip (or, under CI, fail) every docker test with ``reason``."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"docker: {reason} (CI=true: CI runs the docker tests)", pytrace=False)
    pytest.skip(f"docker: {reason}")


def _why_not() -> str:
    if os.geteuid() != 0:
        return "needs root (its own dockerd in a network namespace)"
    for tool, package in (("dockerd", "docker.io"), ("ip", "iproute2"),
                          ("iptables", "iptables"), ("debootstrap", "debootstrap")):
        if shutil.which(tool) is None:
            return f"no `{tool}` (bash scripts/setup.sh --tests installs {package})"
    data_root = os.environ.get("KVPOOL_DOCKER_DATA", "/var/lib/kvpool-docker")
    if _fs_type(data_root) == "overlay":   # the root of a container, as in fresh-machine-check
        return (f"{data_root} is on overlayfs (a container's root?), where dockerd's overlay2 "
                "cannot store images: Docker does not nest here")
    try:
        import testcontainers  # noqa: F401
    except ImportError:
        return "no testcontainers (bash scripts/setup.sh --tests installs it)"
    return ""


def _fs_type(path: str) -> str:
    """The type of the file system ``path`` is (or would be) on: its longest mount point."""
    best, fstype = "", ""
    with open("/proc/self/mounts") as mounts:
        for line in mounts:
            _, point, kind = line.split()[:3]
            point = point.replace("\\040", " ")
            if (path == point or path.startswith(point.rstrip("/") + "/")) and len(point) > len(best):
                best, fstype = point, kind
    return fstype


def _exports() -> dict[str, str]:
    out = subprocess.run(["bash", str(DOCKERD), "env"], capture_output=True, text=True,
                         timeout=30, check=True).stdout
    return dict(line.removeprefix("export ").split("=", 1) for line in out.splitlines())


def _lock():
    """Wait for another session's docker tests to end (they share names and addresses)."""
    LOCK.parent.mkdir(parents=True, exist_ok=True)
    f = open(LOCK, "w")   # noqa: SIM115 - held until the session ends
    deadline = time.monotonic() + LOCK_WAIT_S
    while True:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return f
        except BlockingIOError:
            if time.monotonic() > deadline:
                f.close()
                pytest.fail(f"another session held {LOCK} for {LOCK_WAIT_S} s", pytrace=False)
            time.sleep(1)


def _start_dockerd(env: dict[str, str], docker: str, log: Path) -> subprocess.Popen:
    """dockerd in the foreground of its script (same pid), told to stop if pytest dies."""
    from kvpool.tools.cluster import _die_with_parent
    with open(log, "wb") as out:
        proc = subprocess.Popen(["bash", str(DOCKERD), "run"], stdin=subprocess.DEVNULL,
                                stdout=out, stderr=out, start_new_session=True,
                                preexec_fn=_die_with_parent)  # noqa: PLW1509 - PDEATHSIG only
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        r = subprocess.run([docker, "info"], env={**os.environ, **env}, capture_output=True,
                           timeout=30, check=False)
        if r.returncode == 0:
            return proc
        time.sleep(0.2)
    # The last word of the script and of dockerd's log (read before the stop below removes it).
    said = log.read_text(errors="replace").strip().splitlines()[-1:]
    dockerd_log = Path(os.environ.get("KVPOOL_DOCKER_RUN", "/run/kvpool-docker")) / "dockerd.log"
    if dockerd_log.exists():
        said += dockerd_log.read_text(errors="replace").strip().splitlines()[-1:]
    _stop_dockerd(proc)
    unavailable("dockerd did not start: " + " | ".join(said))
    raise AssertionError("unreachable")


def _stop_dockerd(proc: subprocess.Popen) -> None:
    """SIGTERM (dockerd stops its containers), SIGKILL after 30 s; then whatever is left, the
    namespace, the veth and the cgroups go (the script's stop)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    subprocess.run(["bash", str(DOCKERD), "stop"], capture_output=True, timeout=120,
                   check=False)


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


class _Daemon:
    """The dockerd of this folder's tests, with kvpool's image (and compose's etcd image) built
    on it: started by the first test that asks, stopped after the last of them
    (pytest_runtest_teardown below), or at the session's end however it ends. While it runs,
    os.environ holds the testcontainers settings (testcontainers reads them at import)."""

    def __init__(self) -> None:
        self.docker: Docker | None = None
        self._refusal: Callable[[], None] | None = None   # why it cannot run: skip or fail
        self._close: Callable[[], None] | None = None

    def get(self, tmp_path_factory) -> Docker:
        if self._refusal is not None:
            self._refusal()
        if self.docker is None:
            try:
                self._start(tmp_path_factory)
            except pytest.skip.Exception as e:   # the next tests are told the same at once
                reason = e.msg
                self._refusal = lambda: pytest.skip(reason)
                raise
            except pytest.fail.Exception as e:
                message = e.msg
                self._refusal = lambda: pytest.fail(message, pytrace=False)
                raise
        return self.docker

    def _start(self, tmp_path_factory) -> None:
        if why := _why_not():
            unavailable(why)
        docker = "/usr/bin/docker" if os.access("/usr/bin/docker", os.X_OK) else "docker"
        env = {**_exports(), "DOCKER": docker}
        saved = {k: os.environ.get(k) for k in env}
        lock = _lock()
        # A SIGTERM (a CI job cancelled) must not skip the cleanup.
        previous = signal.signal(signal.SIGTERM, _interrupt)
        proc: subprocess.Popen | None = None

        def close() -> None:
            # Runs to its end (each step has a timeout): a SIGTERM that arrives meanwhile waits.
            terms: list[int] = []
            signal.signal(signal.SIGTERM, lambda signum, frame: terms.append(signum))
            try:
                if proc is not None:
                    _remove_everything(docker, env)
            finally:
                if proc is not None:
                    _stop_dockerd(proc)
                for k, v in saved.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v
                lock.close()
                signal.signal(signal.SIGTERM, previous)
                if terms:
                    os.kill(os.getpid(), signal.SIGTERM)

        self._close = close
        try:
            proc = _start_dockerd(env, docker, tmp_path_factory.mktemp("dockerd") / "out")
            os.environ.update(env)
            started = time.monotonic()
            build = subprocess.run(["bash", str(REPO / "deploy/docker/build-image.sh"),
                                    "--local-base", "--etcd"], capture_output=True, text=True,
                                   timeout=BUILD_TIMEOUT_S, check=False)
            if build.returncode != 0:
                pytest.fail(f"the image did not build:\n{build.stderr[-4000:]}", pytrace=False)
            print(f"\nimage build: {time.monotonic() - started:.1f} s; {build.stderr.strip()}")
            etcd_version = subprocess.run(["etcd", "--version"], capture_output=True, text=True,
                                          timeout=30, check=True).stdout.split()[2]
        except BaseException:
            self.close()
            raise
        self.docker = Docker(ns_ip=env["KVPOOL_DOCKER_NS_IP"], env=env, docker=docker,
                             image=f"kvpool:{_project_version()}",
                             etcd_image=f"kvpool-etcd:{etcd_version}")

    def close(self) -> None:
        close, self._close, self.docker = self._close, None, None
        if close is not None:
            close()


_DAEMON = _Daemon()
HERE = Path(__file__).resolve().parent


@pytest.fixture
def docker_daemon(tmp_path_factory) -> Docker:
    return _DAEMON.get(tmp_path_factory)


def pytest_runtest_teardown(item, nextitem):
    """After the last docker test, not at the session's end: the rest of the suite runs
    without a dockerd, its namespace and the testcontainers settings."""
    if nextitem is None or Path(nextitem.path).resolve().parent != HERE:
        _DAEMON.close()


def pytest_sessionfinish(session, exitstatus):
    _DAEMON.close()


def _project_version() -> str:
    import tomllib
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]


def _remove_everything(docker: str, env: dict[str, str]) -> None:
    """Containers, networks and volumes a test left (a test that failed half-way): the daemon
    is ours alone. Images stay: they are the build cache."""
    def run(*args: str) -> str:
        return subprocess.run([docker, *args], env={**os.environ, **env}, capture_output=True,
                              text=True, timeout=120, check=False).stdout
    if ids := run("ps", "-aq").split():
        run("rm", "-f", "-v", *ids)
    run("network", "prune", "-f")
    if names := run("volume", "ls", "-q").split():
        run("volume", "rm", "-f", *names)


@pytest.fixture
def compose_config(docker_daemon) -> str:
    """DOCKER_CONFIG with Compose v2 as a CLI plugin (scripts/docker/compose-plugin.sh,
    cached)."""
    r = subprocess.run(["bash", str(REPO / "scripts/docker/compose-plugin.sh")],
                       capture_output=True, text=True, timeout=300, check=False)
    if r.returncode != 0:
        pytest.fail(f"no Compose v2 plugin:\n{r.stderr[-2000:]}", pytrace=False)
    return r.stdout.strip()


# -- what the tests ask of a running cluster -----------------------------------------------

def wait_for(pred: Callable, timeout_s: float = 30.0, what: str = "a condition"):
    deadline = time.monotonic() + timeout_s
    while True:
        got = pred()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.2)


def http_get(url: str) -> tuple[int, str]:
    """(status, body) of a GET; (0, why) when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError as e:
        return 0, str(e)


def samples(metrics_text: str) -> dict[str, float]:
    """``name{labels}`` -> value, from Prometheus' text format."""
    out = {}
    for line in metrics_text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def disk_manifest_keys(docker: Docker, container: str, path: str) -> set[str]:
    """The keys a store node's disk tier holds by its manifest log (store_node/disk.py: a line
    per commit or removal), read inside the container."""
    text = docker.run("exec", container, "cat", f"{path}/kvpool-disk.manifest").stdout
    versions: dict[str, int] = {}
    for line in text.splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue   # a line torn mid-write
        if "c" in entry:
            versions[entry["c"][0]] = entry["c"][5]
        elif versions.get(entry["r"][0]) == entry["r"][1]:
            del versions[entry["r"][0]]
    return set(versions)
