"""Checks Grafana dashboard JSON files (deploy/grafana/kvpool-dashboard.json); all but the
last two checks offline:

    python3 scripts/dashboard/check.py [DASHBOARD.json ...] [--against URL_OR_FILE ...]
                                       [--prometheus URL]

- layout: panel ids unique; each panel inside the 24 columns, none overlapping another; each
  query panel on the ${datasource} variable, with a unit, and its queries' refIds unique; every
  variable a query uses is defined;
- types: tsc checks the dashboard against @grafana/schema's Dashboard type, and each panel's
  options and custom field config against its plugin's (types.ts); `bash scripts/setup.sh
  --tests` installs the npm packages (package-lock.json here) outside the checkout, into
  $KVPOOL_ENV_CACHE/dashboard-check-HASH (default /var/cache/kvpool; HASH: the lock file's);
- promql: each query and variable query parses: `promtool check rules` on a rule file with one
  recording rule per expression (promtool cannot check a lone expression);
- metrics (with --against): every metric a query names is served by one of the given /metrics
  pages (a master's and a store node's, or files saved from them), or made by Prometheus (up).
  A type check alone passes queries on metrics that do not exist;
- data (with --prometheus): on a Prometheus that scrapes kvpool, as Grafana would with "All"
  picked in every variable, each variable has values, each query returns series, and each
  series has the labels its legend shows ({{method}}): catches a misspelled label too.

Prints each problem as `FILE: where: what`; exits 1 if there is any, 0 if none (2: bad usage).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
DASHBOARD = REPO / "deploy" / "grafana" / "kvpool-dashboard.json"
LOCK = HERE / "package-lock.json"
# Where scripts/setup.sh --tests installs the npm packages: named by the lock file's hash, so a
# changed lock file means a folder not installed yet, never a stale one.
CHECK_DIR = Path(os.environ.get("KVPOOL_ENV_CACHE") or "/var/cache/kvpool") / (
    "dashboard-check-" + hashlib.sha256(LOCK.read_bytes()).hexdigest()[:12])
SETUP_HINT = "run `bash scripts/setup.sh --tests`"
GRID_COLUMNS = 24
DATASOURCE_UID = "${datasource}"
# Series Prometheus makes for each scrape target: a query may name them too.
PROMETHEUS_SERIES = frozenset({"up", "scrape_duration_seconds", "scrape_samples_scraped",
                               "scrape_samples_post_metric_relabeling", "scrape_series_added"})
# Grafana's interval variables, which PromQL cannot parse where they stand (in a range): a
# duration for promtool. Any other variable outside a string is left for promtool to refuse.
INTERVALS = re.compile(r"\$\{?__(?:rate_interval|interval|range)\b\}?")
INTERVAL_NUMBERS = re.compile(r"\$\{?__(?:rate_interval|interval|range)_m?s\}?")
VARIABLE_USE = re.compile(r"\$(?:\{(\w+)(?::\w+)?\}|(\w+)|\[\[(\w+)(?::\w+)?\]\])")
LABEL_VALUES = re.compile(r"^\s*label_values\(\s*(?:(.*),\s*)?(\w+)\s*\)\s*$", re.DOTALL)
QUERY_RESULT = re.compile(r"^\s*query_result\((.*)\)\s*$", re.DOTALL)
QUERY_PANELS = {"timeseries", "stat", "gauge", "table"}


@dataclass(frozen=True)
class Query:
    where: str      # "panel 101 (Leader) A", "variable instance"
    record: str     # the recording rule that carries it for promtool
    expr: str
    legend: str = ""


class Report:
    def __init__(self, path: Path) -> None:
        self.path, self.problems = path, []
        with contextlib.suppress(ValueError):   # the path as given where it is not below
            self.path = path.resolve().relative_to(Path.cwd())

    def __call__(self, where: str, what: str) -> None:
        self.problems.append(f"{self.path}: {where}: {what}")


# ---- PromQL: the metric names an expression selects ----

_TOKEN = re.compile(r"""
    (?P<space>\s+|\#[^\n]*)
  | (?P<string>"(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])*'|`[^`]*`)
  | (?P<range>\[[^\]]*\])
  | (?P<number>0[xX][0-9a-fA-F]+|(?:\d+(?:ms|s|m|h|d|w|y))+|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)
  | (?P<name>[A-Za-z_:][A-Za-z0-9_:]*)
  | (?P<punct>[(){},]|[^\s\w"'`(){}\[\],]+)
""", re.VERBOSE)
# Keywords that are no metric; after the grouping ones, a parenthesised list names labels.
_GROUPING = {"by", "without", "on", "ignoring", "group_left", "group_right"}
_KEYWORDS = _GROUPING | {"and", "or", "unless", "bool", "offset", "atan2", "inf", "nan"}


def metric_names(expr: str) -> set[str]:
    """The metric names ``expr`` selects (what stands outside braces, strings, ranges, label
    lists, and is no function or keyword). Raises ValueError for a selector by ``__name__``,
    which this cannot check."""
    tokens = [(m.lastgroup, m.group()) for m in _TOKEN.finditer(expr) if m.lastgroup != "space"]
    names: set[str] = set()
    braces, i = 0, 0
    while i < len(tokens):
        kind, text = tokens[i]
        after = tokens[i + 1][1] if i + 1 < len(tokens) else ""
        i += 1
        if text == "{":
            braces += 1
        elif text == "}":
            braces -= 1
        elif braces:
            if text == "__name__":
                raise ValueError("selects metrics by __name__: name them instead")
        elif kind == "name" and text.lower() in _GROUPING and after == "(":
            depth = 0   # skip the label list, to its closing parenthesis
            while i < len(tokens):
                depth += {"(": 1, ")": -1}.get(tokens[i][1], 0)
                i += 1
                if depth == 0:
                    break
        elif kind == "name" and text.lower() not in _KEYWORDS and after != "(" \
                and after.lower() not in ("by", "without"):
            names.add(text)   # else a function, or an aggregation (`sum by (x) (...)` too)
    return names


def for_promtool(expr: str) -> str:
    """``expr`` with Grafana's interval variables replaced by what PromQL parses there."""
    return INTERVALS.sub("5m", INTERVAL_NUMBERS.sub("300", expr))


# ---- the dashboard's panels and queries ----

def all_panels(dashboard: dict) -> Iterator[dict]:
    """Every panel, those inside collapsed rows too."""
    for panel in dashboard.get("panels") or []:
        yield panel
        yield from panel.get("panels") or []


def queries(dashboard: dict, report: Report) -> list[Query]:
    found = []
    for p in all_panels(dashboard):
        for t in p.get("targets") or []:
            where = f"panel {p.get('id')} ({p.get('title')}) {t.get('refId')}"
            if not str(t.get("expr") or "").strip():
                report(where, "a query without an expression")
                continue
            found.append(Query(where, f"dashboard:panel_{p.get('id')}:{t.get('refId')}",
                               t["expr"], str(t.get("legendFormat") or "")))
    for v in (dashboard.get("templating") or {}).get("list") or []:
        if v.get("type") != "query":
            continue
        query = v.get("query")
        text = query.get("query", "") if isinstance(query, dict) else str(query or "")
        where = f"variable {v.get('name')}"
        if m := LABEL_VALUES.match(text):
            if m.group(1):
                found.append(Query(where, f"dashboard:variable_{v.get('name')}", m.group(1)))
        elif m := QUERY_RESULT.match(text):
            found.append(Query(where, f"dashboard:variable_{v.get('name')}", m.group(1)))
        else:
            report(where, f"a query this check cannot read: {text!r} "
                          "(label_values(SELECTOR, LABEL) or query_result(EXPR))")
    return found


def check_layout(dashboard: dict, found: list[Query], report: Report) -> None:
    ids: dict[object, str] = {}
    placed: list[tuple[str, dict]] = []
    top = {id(p) for p in dashboard.get("panels") or []}   # a collapsed row's show when opened
    for p in all_panels(dashboard):
        where = f"panel {p.get('id')} ({p.get('title')})"
        if not isinstance(p.get("id"), int):
            report(where, "no numeric id")
        elif p["id"] in ids:
            report(where, f"id {p['id']} is also {ids[p['id']]}'s")
        else:
            ids[p["id"]] = where
        g = p.get("gridPos") or {}
        if not all(isinstance(g.get(k), int) for k in "xywh"):
            report(where, f"gridPos needs whole numbers x, y, w, h: {g}")
            continue
        if g["x"] < 0 or g["y"] < 0 or g["w"] < 1 or g["h"] < 1 \
                or g["x"] + g["w"] > GRID_COLUMNS:
            report(where, f"gridPos {g} is not inside the {GRID_COLUMNS} columns")
        if id(p) in top:
            for other, h in placed:
                if g["x"] < h["x"] + h["w"] and h["x"] < g["x"] + g["w"] \
                        and g["y"] < h["y"] + h["h"] and h["y"] < g["y"] + g["h"]:
                    report(where, f"overlaps {other}")
            placed.append((where, g))
        if p.get("type") == "row":
            continue
        if p.get("type") not in QUERY_PANELS:
            report(where, f"panel type {p.get('type')!r}: not one of {sorted(QUERY_PANELS)}")
        sources = [p.get("datasource")] + [t.get("datasource") for t in p.get("targets") or []
                                           if "datasource" in t]
        if any((s or {}).get("uid") != DATASOURCE_UID for s in sources):
            report(where, f"its data source is not the {DATASOURCE_UID} variable: {sources}")
        refs = [t.get("refId") for t in p.get("targets") or []]
        if not refs or len(set(refs)) != len(refs) or None in refs:
            report(where, f"needs queries with distinct refIds, has {refs}")
        if p.get("type") != "table" and not (
                (p.get("fieldConfig") or {}).get("defaults") or {}).get("unit"):
            report(where, "no unit (fieldConfig.defaults.unit)")

    variables = {v.get("name") for v in (dashboard.get("templating") or {}).get("list") or []}
    for q in found:
        for m in VARIABLE_USE.finditer(q.expr):
            name = next(g for g in m.groups() if g)
            if not name.startswith("__") and name not in variables:
                report(q.where, f"uses ${name}, which is no variable of the dashboard")


# ---- types: tsc against @grafana/schema ----

def _tsc() -> Path:
    tsc = CHECK_DIR / "node_modules" / ".bin" / "tsc"
    if not tsc.exists() or not shutil.which("node"):
        raise RuntimeError(f"no tsc in {CHECK_DIR} (or no node): {SETUP_HINT}")
    return tsc


def check_schema_version(dashboard: dict, report: Report) -> None:
    """The schemaVersion of the Grafana that the pinned @grafana/schema comes with: an older
    one is migrated by Grafana at each load, a newer one is not understood."""
    r = subprocess.run(["node", "-p", "require('@grafana/schema').defaultDashboard.schemaVersion"],
                       cwd=CHECK_DIR, capture_output=True, text=True, timeout=60, check=False)
    if r.returncode != 0:
        raise RuntimeError(f"node could not load @grafana/schema: {r.stderr.strip()}")
    if dashboard.get("schemaVersion") != int(r.stdout):
        report("schemaVersion", f"{dashboard.get('schemaVersion')!r}, not {int(r.stdout)} as "
                                "in the Grafana of the pinned @grafana/schema")


def check_types(path: Path, text: str, dashboard: dict, report: Report) -> None:
    """The dashboard's own text is the TypeScript value, so tsc's line and column are the
    file's; each panel's options and custom field config follow, one line each."""
    tsc = _tsc()
    check_schema_version(dashboard, report)
    lines = ["import type { CustomJson, DashboardJson, OptionsJson } from './types';",
             "export const dashboard: DashboardJson ="]
    first = len(lines) + 1
    lines += text.rstrip().splitlines()
    lines[-1] += ";"
    extra: dict[int, str] = {}
    for p in all_panels(dashboard):
        if p.get("type") == "row":
            continue
        kind = json.dumps(str(p.get("type")))
        for name, value, typ in (
                ("options", p.get("options") or {}, "OptionsJson"),
                ("fieldConfig.defaults.custom",
                 ((p.get("fieldConfig") or {}).get("defaults") or {}).get("custom") or {},
                 "CustomJson")):
            lines.append(f"export const p{len(lines)}: {typ}<{kind}> = {json.dumps(value)};")
            extra[len(lines)] = f"panel {p.get('id')} ({p.get('title')}) {name}"
    with tempfile.TemporaryDirectory(prefix="dashboard-check.") as tmp:
        work = Path(tmp)
        (work / "node_modules").symlink_to(CHECK_DIR / "node_modules")
        shutil.copy(HERE / "types.ts", work / "types.ts")
        (work / "check.ts").write_text("\n".join(lines) + "\n")
        r = subprocess.run([str(tsc), "--noEmit", "--strict", "--skipLibCheck", "--pretty",
                            "false", "--moduleResolution", "bundler", "--module", "esnext",
                            "--target", "es2020", "check.ts"],
                           cwd=work, capture_output=True, text=True, timeout=120, check=False)
    out = (r.stdout + r.stderr).strip()
    if r.returncode == 0:
        return
    errors = re.findall(r"^check\.ts\((\d+),(\d+)\): error (TS\d+: .*(?:\n(?!check\.ts\().*)*)",
                        out, re.MULTILINE)
    if not errors:
        report("types", f"tsc failed: {out}")
    for line, col, message in errors:
        n = int(line)
        where = extra.get(n) or (f"line {n - first + 1}, column {col}" if n >= first
                                 else f"check.ts line {n}")
        report(where, " ".join(message.split()))


# ---- promql: promtool check rules ----

def check_promql(found: list[Query], report: Report) -> None:
    promtool = shutil.which("promtool")
    if not promtool:
        raise RuntimeError(f"no promtool (Debian prometheus): {SETUP_HINT}")
    by_record = {q.record: q for q in found}
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": q.record, "expr": for_promtool(q.expr)} for q in found]}]}
    with tempfile.TemporaryDirectory(prefix="dashboard-check.") as tmp:
        file = Path(tmp) / "queries.yml"
        file.write_text(json.dumps(rules, indent=1))   # YAML takes JSON as it is
        r = subprocess.run([promtool, "check", "rules", str(file)], capture_output=True,
                           text=True, timeout=60, check=False)
    if r.returncode == 0:
        return
    out = (r.stdout + r.stderr).replace(str(file), "queries.yml")
    attributed = False
    for line in out.splitlines():
        if m := re.search(r'rule \d+, "([^"]+)": (.*)', line):
            q = by_record.get(m.group(1))
            report(q.where if q else m.group(1), f"{m.group(2)}: {q.expr if q else ''}")
            attributed = True
    if not attributed:
        report("promql", f"promtool check rules failed: {out.strip()}")


# ---- metrics: what the real processes serve ----

def served_names(source: str) -> set[str]:
    """The metric names a /metrics page serves (a URL, or a file saved from one): each
    family's samples, a histogram's _bucket, _sum and _count even before its first sample."""
    from prometheus_client.parser import text_string_to_metric_families

    if re.match(r"https?://", source):
        url = source if urllib.parse.urlsplit(source).path not in ("", "/") \
            else source.rstrip("/") + "/metrics"
        with urllib.request.urlopen(url, timeout=10) as r:
            text = r.read().decode()
    else:
        text = Path(source).read_text()
    suffixes = {"counter": ["_total", "_created"], "histogram": ["_bucket", "_sum", "_count",
                                                                  "_created"],
                "summary": ["", "_sum", "_count", "_created"]}
    names = set()
    for family in text_string_to_metric_families(text):
        names |= {family.name + s for s in suffixes.get(family.type, [""])}
        names |= {s.name for s in family.samples}
    return names


def check_metrics(found: list[Query], served: set[str], report: Report) -> None:
    for q in found:
        try:
            names = metric_names(q.expr)
        except ValueError as e:
            report(q.where, str(e))
            continue
        for name in sorted(names - served - PROMETHEUS_SERIES):
            report(q.where, f"{name} is not a metric kvpool serves: {q.expr}")


# ---- data: what a real Prometheus answers ----

def _api(prometheus: str, path: str, **params: str) -> object:
    """The ``data`` of a Prometheus HTTP API answer; RuntimeError with its error if it failed."""
    url = f"{prometheus.rstrip('/')}/api/v1/{path}?{urllib.parse.urlencode(params)}"
    try:
        try:
            with urllib.request.urlopen(url, timeout=30) as r:
                answer = json.load(r)
        except urllib.error.HTTPError as e:   # a bad query: 400 with the parser's error
            answer = json.load(e)
    except ValueError as e:
        raise RuntimeError(f"{url} answered no JSON: {e}") from None
    except urllib.error.URLError as e:   # none answers: no use asking again for each query
        raise ConnectionError(f"{prometheus}: {e.reason}") from None
    if answer.get("status") != "success":
        raise RuntimeError(answer.get("error") or answer)
    return answer["data"]


def _regex_escaped(value: str) -> str:
    # As Grafana puts a value into a PromQL regex matcher ("...=~"): regex metacharacters
    # escaped, and the backslash doubled for the PromQL string.
    return re.sub(r"([\\^$*+?.()|{}\[\]])", r"\\\1", value).replace("\\", "\\\\")


def _interpolate(expr: str, values: dict[str, str], interval: str) -> str:
    expr = INTERVAL_NUMBERS.sub("60", INTERVALS.sub(interval, expr))
    return VARIABLE_USE.sub(lambda m: values.get(next(g for g in m.groups() if g), m.group()),
                            expr)


def check_data(dashboard: dict, found: list[Query], prometheus: str, report: Report,
               interval: str = "1m") -> None:
    """Resolve the variables with "All" picked, as Grafana does, then run every query."""
    values: dict[str, str] = {}
    for v in (dashboard.get("templating") or {}).get("list") or []:
        query = v.get("query")
        text = query.get("query", "") if isinstance(query, dict) else str(query or "")
        if v.get("type") != "query" or not (m := LABEL_VALUES.match(text)):
            continue
        where = f"variable {v.get('name')}"
        params = {"match[]": _interpolate(m.group(1), values, interval)} if m.group(1) else {}
        try:
            labels = sorted(_api(prometheus, f"label/{m.group(2)}/values", **params))
        except RuntimeError as e:
            report(where, f"Prometheus answered: {e}")
            continue
        if not labels:
            report(where, f"no values on {prometheus}: {text}")
        values[v["name"]] = v.get("allValue") if v.get("includeAll") and v.get("allValue") \
            else "(" + "|".join(map(_regex_escaped, labels)) + ")"
    for q in found:
        if q.where.startswith("variable "):   # asked above
            continue
        expr = _interpolate(q.expr, values, interval)
        try:
            result = _api(prometheus, "query", query=expr)["result"]
        except RuntimeError as e:
            report(q.where, f"Prometheus answered: {e}: {expr}")
            continue
        if not result:
            report(q.where, f"no data on {prometheus}: {expr}")
        for label in re.findall(r"\{\{\s*(\w+)\s*\}\}", q.legend):
            if any(label not in series["metric"] for series in result):
                report(q.where, f"its legend shows {{{{{label}}}}}, a label its series lack: "
                                f"{expr}")


def check(path: Path, served: set[str] | None, prometheus: str | None = None) -> list[str]:
    """Every problem of the dashboard at ``path``; ``served``: the metric names to allow (the
    metrics check is left out without); ``prometheus``: a URL to run the queries on."""
    report = Report(path)
    text = path.read_text()
    try:
        dashboard = json.loads(text)
    except json.JSONDecodeError as e:
        report("json", str(e))
        return report.problems
    if not isinstance(dashboard, dict):
        report("json", "not a JSON object")
        return report.problems
    found = queries(dashboard, report)
    check_layout(dashboard, found, report)
    check_types(path, text, dashboard, report)
    check_promql(found, report)
    if served is not None:
        check_metrics(found, served, report)
    if prometheus:
        check_data(dashboard, found, prometheus, report)
    return report.problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dashboards", nargs="*", type=Path, default=[DASHBOARD],
                    help="dashboard JSON files (default: deploy/grafana/kvpool-dashboard.json)")
    ap.add_argument("--against", action="append", default=[], metavar="URL_OR_FILE",
                    help="a /metrics page (http://HOST:PORT[/metrics]) or a file saved from "
                         "one; the queries may name only the metrics these serve")
    ap.add_argument("--prometheus", metavar="URL",
                    help="a Prometheus that scrapes kvpool (http://HOST:9090): every query "
                         "must return series there")
    args = ap.parse_args(argv)
    try:
        served = set().union(*(served_names(s) for s in args.against)) if args.against \
            else None
        problems = [p for d in args.dashboards for p in check(d, served, args.prometheus)]
    except (OSError, RuntimeError, subprocess.TimeoutExpired) as e:
        print(f"check.py: {e}", file=sys.stderr)
        return 1
    for p in problems:
        print(p)
    if not problems:
        checked = "layout, types, promql" + (", metrics" if served is not None else "") \
            + (", data" if args.prometheus else "")
        print(f"OK ({checked}): {' '.join(str(d) for d in args.dashboards)}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
