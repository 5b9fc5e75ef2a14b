"""The Grafana dashboard against a real cluster (scripts/dashboard/check.py): its queries name
only metrics that a real master and store node serve on /metrics (a type check alone passes a
query on a metric that does not exist), and on a real Prometheus scraping them every query
returns series with the labels its legend shows."""

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
import warnings
from pathlib import Path

import pytest
from kvpool.client.kv_client import KVClient
from kvpool.common.errors import InvalidArgument, ObjectNotFound
from kvpool.rpc.master_client import MasterClient
from kvpool.tools.cluster import LocalCluster

from .conftest import FAST_MASTER, FAST_NODE

REPO = Path(__file__).resolve().parents[2]
CHECK = REPO / "scripts" / "dashboard" / "check.py"
DASHBOARD = REPO / "deploy" / "grafana" / "kvpool-dashboard.json"
UPCOMING = REPO / "scripts" / "dashboard" / "upcoming-panels.json"
NOT_SERVED = re.compile(r"^(?P<file>[^:]+): .*: (?P<name>\w+) is not a metric kvpool serves",
                        re.MULTILINE)
# The metrics the upcoming panels wait for (another change adds them to the nodes and master).
UPCOMING_METRICS = {
    "kvpool_node_requests_total", "kvpool_node_bytes_total", "kvpool_node_connections",
    "kvpool_node_scrub_checked_bytes_total", "kvpool_node_scrub_mismatches_total",
    "kvpool_node_manifest_unacked_changes", "kvpool_master_namespace_lookups_total",
    "kvpool_master_leases", "kvpool_master_pins_bytes", "kvpool_master_leader_changes_total",
    "kvpool_master_lookup_port_calls_total"}
SCRAPE_INTERVAL_S = 1
READY_TIMEOUT_S = 30.0


def _check(*args: object, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(CHECK), *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=120, check=False)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A real master and store node serving /metrics; fails the test if either logged a
    traceback."""
    logs = tmp_path_factory.mktemp("logs")
    c = LocalCluster(nodes=1, segment_size="8MiB", master_args=FAST_MASTER, node_args=FAST_NODE,
                     log_dir=logs, metrics=True)
    with c:
        yield c
    for log in logs.glob("*.log"):
        assert "Traceback" not in log.read_text(), log.name


def test_the_dashboard_names_only_metrics_a_real_master_and_store_node_serve(cluster, tmp_path):
    misspelled = tmp_path / "misspelled.json"
    misspelled.write_text(DASHBOARD.read_text().replace("kvpool_master_lookups_total",
                                                        "kvpool_master_lookup_total"))
    against = [arg for name in ("master", "node0")
               for arg in ("--against", f"http://{cluster.metrics_addresses[name]}/metrics")]
    # One run for the three files: each problem line starts with its file's path.
    r = _check(DASHBOARD, misspelled, UPCOMING, *against, cwd=tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    reported: dict[str, set[str]] = {}
    for m in NOT_SERVED.finditer(r.stdout):
        reported.setdefault(Path(m["file"]).name, set()).add(m["name"])
    assert len(NOT_SERVED.findall(r.stdout)) == len(r.stdout.splitlines()), r.stdout

    assert DASHBOARD.name not in reported, r.stdout
    assert reported.get(misspelled.name) == {"kvpool_master_lookup_total"}
    waiting = reported.get(UPCOMING.name, set())
    assert waiting <= UPCOMING_METRICS, waiting - UPCOMING_METRICS
    if UPCOMING_METRICS - waiting:
        # Said, not failed: whoever adds a metric need not move its panels in the same change.
        warnings.warn(f"served now: {sorted(UPCOMING_METRICS - waiting)}; move their panels from "
                      f"{UPCOMING.relative_to(REPO)} into {DASHBOARD.relative_to(REPO)}",
                      stacklevel=1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _query(prometheus: str, expr: str) -> list[dict]:
    url = f"{prometheus}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.load(r)["data"]["result"]


@pytest.fixture
def prometheus(cluster, tmp_path):
    """A real Prometheus (Debian's, which `bash scripts/setup.sh --tests` installs) scraping the
    cluster every second as the README names the jobs; its URL. Stopped after the test."""
    binary = shutil.which("prometheus")
    assert binary, "prometheus is missing: run `bash scripts/setup.sh --tests` (Debian prometheus)"
    config = tmp_path / "prometheus.yml"
    config.write_text(json.dumps({   # YAML takes JSON as it is
        "global": {"scrape_interval": f"{SCRAPE_INTERVAL_S}s",
                   "scrape_timeout": f"{SCRAPE_INTERVAL_S}s"},
        "scrape_configs": [
            {"job_name": job, "static_configs": [{"targets": [cluster.metrics_addresses[p]]}]}
            for job, p in (("kvpool-master", "master"), ("kvpool-store-node", "node0"))]}))
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


def test_on_a_real_prometheus_every_query_returns_the_series_its_legend_shows(cluster,
                                                                               prometheus,
                                                                               tmp_path):
    # What the panels show: hits and misses, puts, and a call answered with an error code.
    with KVClient(cluster.master) as kv:
        kv.put("a", b"x" * 1000)
        assert kv.get("a") == b"x" * 1000
        with pytest.raises(ObjectNotFound):
            kv.get("absent")
    with MasterClient(cluster.master) as mc, pytest.raises(InvalidArgument):
        mc.put_start(["c", "d"], [10])
    # rate() needs two samples of a series, the newest (the refused call's) included.
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not _query(prometheus, 'count_over_time(kvpool_master_rpcs_total'
                                 '{code="INVALID_ARGUMENT"}[1m]) >= 2'):
        assert time.monotonic() < deadline, "Prometheus did not scrape the cluster twice"
        time.sleep(SCRAPE_INTERVAL_S / 2)

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
