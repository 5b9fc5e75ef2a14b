"""deploy/grafana: the dashboard passes scripts/dashboard/check.py (layout; tsc against the
pinned @grafana/schema, which `bash scripts/setup.sh --tests` installs; promtool parses every
query), the check finds each kind of fault, and the provisioning files point Grafana at the
compose deployment's Prometheus and at the dashboard. Whether the queries name only metrics
kvpool serves, and return data on a real Prometheus scraping a real cluster:
tests/integration/test_grafana_dashboard_live.py."""

from __future__ import annotations

import copy
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHECK = REPO / "scripts" / "dashboard" / "check.py"
DASHBOARD = REPO / "deploy" / "grafana" / "kvpool-dashboard.json"
PROVISIONING = REPO / "deploy" / "grafana" / "provisioning"


def _run_check(*args: object) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(CHECK), *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, timeout=120, check=False)


@pytest.fixture(scope="module")
def check():
    """scripts/dashboard/check.py as a module (scripts are run by path, not installed)."""
    spec = importlib.util.spec_from_file_location("dashboard_check", CHECK)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def _panels(dashboard: dict) -> dict[int, dict]:
    return {p["id"]: p for p in dashboard["panels"]}


def test_the_dashboard_passes_the_check():
    r = _run_check(DASHBOARD)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith("OK (layout, types, promql)")


def test_the_check_reports_each_fault_where_it_is(tmp_path):
    broken = json.loads(DASHBOARD.read_text())
    p = _panels(broken)
    p[101]["gridPos"]["w"] = "4"                                     # a string for a number
    p[102]["fieldConfig"]["defaults"]["thresholds"]["mode"] = "absolut"   # no such enum value
    p[103]["options"]["colorMode"] = "backgroud"                     # the stat plugin's options
    p[104]["options"]["grafMode"] = "none"                           # an option it does not have
    p[107]["targets"][0]["expr"] = "sum(kvpool_master_objects"       # PromQL that cannot parse
    p[108]["gridPos"] = copy.deepcopy(p[107]["gridPos"])            # on top of another panel
    p[203]["id"] = 202                                               # an id taken
    p[301]["targets"][0]["expr"] = p[301]["targets"][0]["expr"].replace("$master_job",
                                                                        "$mastr_job")
    p[302]["datasource"] = {"type": "prometheus", "uid": "P1809F7CD0C75ACF3"}   # one Grafana's
    del p[401]["fieldConfig"]["defaults"]["unit"]
    broken["schemaVersion"] = 39
    file = tmp_path / "broken.json"
    file.write_text(json.dumps(broken, indent=2))

    r = _run_check(file)
    assert r.returncode == 1, r.stdout + r.stderr
    expected = [
        ("panel 101 (Leader)", "gridPos needs whole numbers"),
        ("line ", "Type 'string' is not assignable to type 'number'"),
        ("line ", '"absolut"'),
        ("panel 103 (Store nodes not ready) options", '"backgroud"'),
        ("panel 104 (Store nodes down) options", "grafMode"),
        ("panel 107 (Objects indexed) A", "unclosed left parenthesis"),
        ("panel 108 (Corrupt replicas dropped)", "overlaps panel 107"),
        ("panel 202 (Lookups)", "id 202 is also panel 202 (Hit rate)'s"),
        ("panel 301 (gRPC calls by method) A", "uses $mastr_job, which is no variable"),
        ("panel 302 (gRPC errors by code)", "data source is not the ${datasource} variable"),
        ("panel 401 (gRPC latency p50 by method)", "no unit"),
        ("schemaVersion", "39, not 42"),
    ]
    lines = r.stdout.splitlines()
    for where, what in expected:
        assert any(f": {where}" in line and what in line for line in lines), (where, what, lines)
    assert len(lines) == len(expected), lines


@pytest.mark.parametrize("expr, names", [
    ("up", {"up"}),
    ('sum by (method, le) (rate(kvpool_master_rpc_seconds_bucket{job=~"$j"}[$__rate_interval]))',
     {"kvpool_master_rpc_seconds_bucket"}),
    ("sum(rate(a_total[5m])) by (code) / ignoring (code) group_left (x) sum without (y) (b)",
     {"a_total", "b"}),
    ('count(kvpool_node_ready{node=~"n.*", tier="dram"} == 0) or vector(0)', {"kvpool_node_ready"}),
    ('label_replace(a, "dst", "$1", "src", "(by|on) ignored")', {"a"}),
    ("a offset 5m and on (instance) b > bool 1 unless c @ start()", {"a", "b", "c"}),
    ("max_over_time(rate(a[5m])[1h:1m]) * 1e3 + Inf - 0x1f", {"a"}),
    ("histogram_quantile(0.99, x:recorded:rate5m)", {"x:recorded:rate5m"}),
])
def test_metric_names_are_what_stands_outside_labels_strings_and_functions(check, expr, names):
    assert check.metric_names(expr) == names


def test_a_selector_by_name_cannot_be_checked(check):
    with pytest.raises(ValueError, match="__name__"):
        check.metric_names('{__name__=~"kvpool_.*"}')


def test_the_dashboard_has_the_rows_and_variables_it_promises():
    d = json.loads(DASHBOARD.read_text())
    rows = [p["title"] for p in d["panels"] if p["type"] == "row"]
    assert rows == ["Cluster health", "Hit rate", "Throughput", "Latency", "Capacity per tier",
                    "Store nodes", "Clients"]
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert list(variables) == ["datasource", "master_job", "node_job", "instance", "node",
                               "client_job"]
    assert (variables["datasource"]["type"], variables["datasource"]["query"]) == \
        ("datasource", "prometheus")
    # Panels sit under their row: sorted by position, each row's panels come before the next.
    ordered = sorted(d["panels"], key=lambda p: (p["gridPos"]["y"], p["gridPos"]["x"]))
    assert [p["id"] // 100 for p in ordered] == sorted(p["id"] // 100 for p in ordered)


def test_provisioning_points_grafana_at_the_compose_prometheus_and_the_dashboard():
    sources = yaml.safe_load((PROVISIONING / "datasources" / "kvpool.yaml").read_text())
    assert sources["apiVersion"] == 1
    [source] = sources["datasources"]
    assert {k: source[k] for k in ("type", "uid", "url", "access")} == {
        "type": "prometheus", "uid": "prometheus", "url": "http://prometheus:9090",
        "access": "proxy"}
    boards = yaml.safe_load((PROVISIONING / "dashboards" / "kvpool.yaml").read_text())
    assert boards["apiVersion"] == 1
    [provider] = boards["providers"]
    assert provider["type"] == "file"
    assert provider["options"]["path"] == "/var/lib/grafana/dashboards"
