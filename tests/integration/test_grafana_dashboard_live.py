"""The Grafana dashboard against a real cluster (scripts/dashboard/check.py): its queries name
only metrics that a real master, store node and client serve on /metrics (a type check alone
passes a query on a metric that does not exist), and on a real Prometheus scraping them every
query returns series with the labels its legend shows."""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from kvpool.client.kv_client import KVClient
from kvpool.common.errors import InvalidArgument, ObjectNotFound
from kvpool.common.metrics import MetricsServer
from kvpool.rpc.master_client import MasterClient
from kvpool.tools.cluster import LocalCluster
from prometheus_client import CollectorRegistry

from .conftest import FAST_MASTER, FAST_NODE

REPO = Path(__file__).resolve().parents[2]
CHECK = REPO / "scripts" / "dashboard" / "check.py"
DASHBOARD = REPO / "deploy" / "grafana" / "kvpool-dashboard.json"
NOT_SERVED = re.compile(r"^(?P<file>[^:]+): .*: (?P<name>\w+) is not a metric kvpool serves",
                        re.MULTILINE)
# Keys in a namespace (master --namespace-depth 3) for the per-namespace panels.
NAMESPACE = "kvpool/test/model"
SCRAPE_INTERVAL_S = 1
READY_TIMEOUT_S = 30.0


def _check(*args: object, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(CHECK), *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=120, check=False)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A real master and store node serving /metrics, the master restarted once (so it serves
    how long its index rebuild took), the node scrubbing every second; fails the test if a
    process logged a traceback."""
    logs = tmp_path_factory.mktemp("logs")
    c = LocalCluster(nodes=1, segment_size="8MiB", master_args=FAST_MASTER,
                     node_args=[*FAST_NODE, "--scrub-interval", "1s"], log_dir=logs, metrics=True)
    with c:
        with KVClient(c.master) as kv:   # an object for the node to re-announce
            kv.put(f"{NAMESPACE}/kept", b"k" * 100)
        c.restart_master()   # its metrics port is a new one: Prometheus starts after this
        _wait_for_rebuild(c.metrics_addresses["master"])
        yield c
    for log in logs.glob("*.log"):
        assert "Traceback" not in log.read_text(), log.name


def _wait_for_rebuild(metrics_address: str) -> None:
    """Until the master serves how long its index rebuild took: its node re-mounted and
    announced what it holds (the master is ready before, while it has no segment)."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        with urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=5) as r:
            if re.search(r"^kvpool_master_recovery_seconds ", r.read().decode(), re.MULTILINE):
                return
        assert time.monotonic() < deadline, "the restarted master did not rebuild its index"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def engine():
    """What an engine serves: a registry that kvpool clients count in (KVClient(metrics=)),
    on /metrics; its registry and address. Stopped after the tests."""
    registry = CollectorRegistry()
    with MetricsServer(registry, lambda: None) as server:
        yield registry, server.address


def test_the_dashboard_names_only_metrics_a_real_master_node_and_client_serve(cluster, engine,
                                                                              tmp_path):
    registry, engine_address = engine
    with KVClient(cluster.master, metrics=registry):   # its metrics, on the engine's page
        pass
    misspelled = tmp_path / "misspelled.json"
    misspelled.write_text(DASHBOARD.read_text().replace("kvpool_master_lookups_total",
                                                        "kvpool_master_lookup_total"))
    pages = [f"http://{cluster.metrics_addresses[name]}/metrics" for name in ("master", "node0")]
    against = [arg for page in (*pages, f"http://{engine_address}/metrics")
               for arg in ("--against", page)]
    # One run for both files: each problem line starts with its file's path.
    r = _check(DASHBOARD, misspelled, *against, cwd=tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    reported: dict[str, set[str]] = {}
    for m in NOT_SERVED.finditer(r.stdout):
        reported.setdefault(Path(m["file"]).name, set()).add(m["name"])
    assert len(NOT_SERVED.findall(r.stdout)) == len(r.stdout.splitlines()), r.stdout
    assert reported == {misspelled.name: {"kvpool_master_lookup_total"}}, r.stdout


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _query(prometheus: str, expr: str) -> list[dict]:
    url = f"{prometheus}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.load(r)["data"]["result"]


def _wait_for_scrapes(prometheus: str, since: float, scrapes: int = 2) -> None:
    """Until Prometheus has scraped every target, each up, ``scrapes`` times since ``since``
    (a time.time())."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        window_ms = int((time.time() - since) * 1000)   # ends at the query's time, now
        if window_ms > 0 and _query(prometheus, f"min(count_over_time(up[{window_ms}ms])) >= "
                                                f"{scrapes} and count(up == 1) == 3"):
            return
        assert time.monotonic() < deadline, "Prometheus did not scrape every target"
        time.sleep(SCRAPE_INTERVAL_S / 4)


@pytest.fixture
def prometheus(cluster, engine, tmp_path):
    """A real Prometheus (Debian's, which `bash scripts/setup.sh --tests` installs) scraping the
    cluster every second as the README names the jobs, and the engine; its URL. Stopped after
    the test."""
    binary = shutil.which("prometheus")
    assert binary, "prometheus is missing: run `bash scripts/setup.sh --tests` (Debian prometheus)"
    config = tmp_path / "prometheus.yml"
    config.write_text(json.dumps({   # YAML takes JSON as it is
        "global": {"scrape_interval": f"{SCRAPE_INTERVAL_S}s",
                   "scrape_timeout": f"{SCRAPE_INTERVAL_S}s"},
        "scrape_configs": [
            {"job_name": job, "static_configs": [{"targets": [address]}]}
            for job, address in (("kvpool-master", cluster.metrics_addresses["master"]),
                                 ("kvpool-store-node", cluster.metrics_addresses["node0"]),
                                 ("engine", engine[1]))]}))
    url = f"http://127.0.0.1:{_free_port()}"
    with open(tmp_path / "prometheus.log", "wb") as log:
        # setpriv (util-linux): Prometheus ends with this test's process however that ends.
        proc = subprocess.Popen(
            ["setpriv", "--pdeathsig", "TERM", binary, f"--config.file={config}",
             f"--storage.tsdb.path={tmp_path / 'data'}", "--log.level=warn",
             f"--web.listen-address={url.removeprefix('http://')}"],
            stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            assert proc.poll() is None, (tmp_path / "prometheus.log").read_text()
            try:
                with urllib.request.urlopen(f"{url}/-/ready", timeout=1):
                    break
            except (urllib.error.URLError, ConnectionError):
                assert time.monotonic() < deadline, "Prometheus did not get ready"
                time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_on_a_real_prometheus_every_query_returns_the_series_its_legend_shows(cluster, engine,
                                                                               prometheus,
                                                                               tmp_path):
    # What the panels show: hits and misses (in a namespace, and in none), puts (one pinned),
    # lookups on the lookup port (a client's first one goes over gRPC and learns the port),
    # reads and writes on the node's tcp data port from a client still connected, a call
    # answered with an error code; and the client's own figures, on the engine's /metrics.
    with KVClient(cluster.master, transports=["tcp"], metrics=engine[0]) as kv:
        kv.put(f"{NAMESPACE}/a", b"x" * 1000, pin=True)
        kv.put("plain", b"y" * 10)
        assert kv.get(f"{NAMESPACE}/a") == b"x" * 1000
        assert kv.get(f"{NAMESPACE}/kept") == b"k" * 100
        assert kv.get("plain") == b"y" * 10
        with pytest.raises(ObjectNotFound):
            kv.get(f"{NAMESPACE}/absent")
        assert kv.batch_exists([f"{NAMESPACE}/a", "absent"]) == [True, False]
        with MasterClient(cluster.master) as mc, pytest.raises(InvalidArgument):
            mc.put_start(["c", "d"], [10])
        # rate() and increase() need two samples of each series these calls made.
        _wait_for_scrapes(prometheus, since=time.time())
        for expr in ('kvpool_master_lookup_port_calls_total{method="GetReplicas"}',
                     'kvpool_master_lookup_port_calls_total{method="Exists"}',
                     'kvpool_node_bytes_total{transport="tcp", op="WRITE"}',
                     'kvpool_node_connections{transport="tcp"}', "kvpool_master_pinned_bytes",
                     "kvpool_node_scrub_checked_objects_total", "kvpool_master_committed_total",
                     'kvpool_client_keys_total{op="get", result="miss"}'):
            assert _query(prometheus, f"{expr} > 0"), f"the workload left {expr} at 0"

    r = _check(DASHBOARD, "--prometheus", prometheus, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "data" in r.stdout

    # And a label misspelled in a query's grouping is caught (the series lack it).
    broken = tmp_path / "broken.json"
    broken.write_text(DASHBOARD.read_text().replace("sum by (method) (rate(kvpool_master_rpcs",
                                                    "sum by (metod) (rate(kvpool_master_rpcs"))
    r = _check(broken, "--prometheus", prometheus, cwd=tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "panel 301 (gRPC calls by method) A: its legend shows {{method}}" in r.stdout, r.stdout
