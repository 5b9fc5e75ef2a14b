"""``kvpool bench`` results: ratios against the baselines, targets, the table, JSON and plots.

Pure functions over plain data (no I/O except :func:`write_plots`), so the benchmark's
arithmetic and its JSON schema are tested without running a cluster.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

SCHEMA = "kvpool-bench/1"

# (ratio name, numerator, denominator); a figure is (system, transport, workload, op).
RATIO_DEFINITIONS: tuple[tuple[str, tuple[str, str, str, str], tuple[str, str, str, str]], ...] = (
    ("shm_get_vs_memcpy", ("kvpool", "shm", "prompt", "get"), ("memcpy", "-", "prompt", "copy")),
    ("shm_put_vs_memcpy", ("kvpool", "shm", "prompt", "put"), ("memcpy", "-", "prompt", "copy")),
    ("tcp_get_vs_raw_tcp", ("kvpool", "tcp", "prompt", "get"), ("raw_tcp", "tcp", "prompt", "get")),
    ("tcp_put_vs_raw_tcp", ("kvpool", "tcp", "prompt", "put"), ("raw_tcp", "tcp", "prompt", "put")),
    ("tcp_get_vs_redis", ("kvpool", "tcp", "prompt", "get"), ("redis", "tcp", "prompt", "get")),
    ("tcp_put_vs_redis", ("kvpool", "tcp", "prompt", "put"), ("redis", "tcp", "prompt", "put")),
    ("small_shm_get_vs_memcpy", ("kvpool", "shm", "small", "get"),
     ("memcpy", "-", "small", "copy")),
    # With --peers mooncake (None otherwise): Mooncake Store's own tcp transport.
    ("tcp_get_vs_mooncake", ("kvpool", "tcp", "prompt", "get"),
     ("mooncake", "tcp", "prompt", "get")),
    ("tcp_put_vs_mooncake", ("kvpool", "tcp", "prompt", "put"),
     ("mooncake", "tcp", "prompt", "put")),
    ("mooncake_get_vs_raw_tcp", ("mooncake", "tcp", "prompt", "get"),
     ("raw_tcp", "tcp", "prompt", "get")),
    # With --peers mooncake: Mooncake's same-host path (the bench's client mounts the segment
    # its values live in: a local memcpy, no transfer; tools/bench_mooncake.py), beside shm.
    ("shm_get_vs_mooncake_local", ("kvpool", "shm", "prompt", "get"),
     ("mooncake", "local", "prompt", "get")),
    ("shm_put_vs_mooncake_local", ("kvpool", "shm", "prompt", "put"),
     ("mooncake", "local", "prompt", "put")),
)
# Single calls (issue 19): (ratio name, numerator, denominator, value bytes), each a p50
# latency ratio (system, transport, op), so <= 1.0 is as fast as the peer or faster.
SINGLE_P50_DEFINITIONS: tuple[tuple[str, tuple[str, str, str], tuple[str, str, str], int],
                              ...] = (
    ("single_put_64KiB_shm_p50_vs_mooncake_local", ("kvpool", "shm", "put"),
     ("mooncake", "local", "put"), 64 << 10),
    ("single_put_1MiB_shm_p50_vs_mooncake_local", ("kvpool", "shm", "put"),
     ("mooncake", "local", "put"), 1 << 20),
    ("single_put_64KiB_tcp_p50_vs_mooncake", ("kvpool", "tcp", "put"),
     ("mooncake", "tcp", "put"), 64 << 10),
    ("single_put_1MiB_tcp_p50_vs_mooncake", ("kvpool", "tcp", "put"),
     ("mooncake", "tcp", "put"), 1 << 20),
    ("single_get_64KiB_shm_p50_vs_redis", ("kvpool", "shm", "get"), ("redis", "tcp", "get"),
     64 << 10),
    ("single_get_64KiB_tcp_p50_vs_mooncake", ("kvpool", "tcp", "get"),
     ("mooncake", "tcp", "get"), 64 << 10),
)
MASTER_FIGURES = ("put_objects_per_s", "lookup_objects_per_s", "bytes_per_object")
# With --compare-insecure: kvpool's figures on a second local cluster, without credentials.
PLAIN = "kvpool-plain"
# Issue 15: security costs at most 10% of every data-path ratio (throughput: secure/plain >=
# 0.9; a single call's p50: secure/plain <= 1.1). Each is "<ratio>_secure_vs_plain".
SECURITY_BOUND = 0.1

# The targets: (figure, ">=" or "<=", bound). Ratios are medians from one run.
TARGETS: tuple[tuple[str, str, float], ...] = (
    ("shm_get_vs_memcpy", ">=", 0.8),
    ("shm_put_vs_memcpy", ">=", 0.6),
    ("tcp_get_vs_raw_tcp", ">=", 0.6),
    ("tcp_put_vs_raw_tcp", ">=", 0.5),
    ("tcp_get_vs_redis", ">=", 2.0),
    ("small_shm_get_vs_memcpy", ">=", 0.4),
    ("shm_get_vs_mooncake_local", ">=", 1.0),
    ("shm_put_vs_mooncake_local", ">=", 0.9),
    # Issue 19: batches of 256 keys; RSS growth per indexed object (measured at 10M objects).
    ("master.put_objects_per_s", ">=", 50_000),
    ("master.lookup_objects_per_s", ">=", 300_000),
    ("master.bytes_per_object", "<=", 300),
    *((name, "<=", 1.0) for name, *_ in SINGLE_P50_DEFINITIONS),
)


@dataclass(frozen=True)
class Figure:
    """One measured workload: medians over repeats, latency percentiles over all calls."""

    system: str              # kvpool | memcpy | raw_tcp | redis | mooncake
    transport: str           # shm | tcp | local (Mooncake same-host) | "-" (memcpy)
    workload: str            # prompt (batch) | small (batch of small values) | single
    op: str                  # put | get | copy
    value_bytes: int         # bytes per object
    objects_per_call: int
    gbps: float              # median over repeats, 1e9 bytes/s
    objects_per_s: float     # median over repeats
    p50_ms: float            # per call
    p99_ms: float
    repeats: int
    calls: int               # calls timed, all repeats together

    @property
    def key(self) -> tuple[str, str, str, str]:
        return (self.system, self.transport, self.workload, self.op)


def summarize(system: str, transport: str, workload: str, op: str, value_bytes: int,
              objects_per_call: int, repeat_latencies_s: Sequence[Sequence[float]]) -> Figure:
    """A Figure from per-call latencies grouped by repeat (each repeat's rate, then the median)."""
    if not repeat_latencies_s or not all(repeat_latencies_s):
        raise ValueError("every repeat needs at least one timed call")
    call_bytes = value_bytes * objects_per_call
    rates = [len(r) / sum(r) for r in repeat_latencies_s]     # calls per second
    flat = sorted(x for r in repeat_latencies_s for x in r)
    calls_per_s = statistics.median(rates)
    return Figure(system, transport, workload, op, value_bytes, objects_per_call,
                  gbps=calls_per_s * call_bytes / 1e9,
                  objects_per_s=calls_per_s * objects_per_call,
                  p50_ms=_percentile(flat, 50) * 1e3, p99_ms=_percentile(flat, 99) * 1e3,
                  repeats=len(repeat_latencies_s), calls=len(flat))


def across(figures: Sequence[Figure]) -> Figure:
    """One workload's figures from several clusters (``kvpool bench --cluster-pairs``) as
    one: each rate and latency the median of the clusters' (a cluster that was slower all
    its life, as one of two identical ones can be, moves it less than pooling its calls
    would), the repeats and calls timed summed."""
    if len(figures) == 1:
        return figures[0]
    med = {name: statistics.median(getattr(f, name) for f in figures)
           for name in ("gbps", "objects_per_s", "p50_ms", "p99_ms")}
    return replace(figures[0], **med, repeats=sum(f.repeats for f in figures),
                   calls=sum(f.calls for f in figures))


def _percentile(sorted_values: Sequence[float], pct: float) -> float:
    """Nearest-rank percentile of an ascending sequence."""
    rank = max(1, -(-len(sorted_values) * pct // 100))
    return sorted_values[int(rank) - 1]


def compute_ratios(figures: Iterable[Figure], master: dict | None) -> dict:
    """The ratios the issue names (None where a side was not measured), and ``master``; with
    the plain cluster's figures (PLAIN) each of kvpool's ratios also as ``<name>_plain`` and
    ``<name>_secure_vs_plain``."""
    by_key = {f.key: f for f in figures}
    single = {(f.system, f.transport, f.op, f.value_bytes): f for f in figures
              if f.workload == "single"}
    plain = any(f.system == PLAIN for f in by_key.values())
    ratios: dict = {}
    for system, suffix in (("kvpool", ""), (PLAIN, "_plain"))[:1 + plain]:
        for name, num, den in RATIO_DEFINITIONS:
            if num[0] == "kvpool":
                ratios[name + suffix] = _ratio(by_key.get((system, *num[1:])), by_key.get(den),
                                               "gbps")
            elif not suffix:   # a peer's own ratio
                ratios[name] = _ratio(by_key.get(num), by_key.get(den), "gbps")
        for name, num, den, size in SINGLE_P50_DEFINITIONS:   # each kvpool's, by p50
            ratios[name + suffix] = _ratio(single.get((system, *num[1:], size)),
                                           single.get((*den, size)), "p50_ms")
    for name in [n for n in ratios if n + "_plain" in ratios]:
        secure, insecure = ratios[name], ratios[name + "_plain"]
        ratios[f"{name}_secure_vs_plain"] = round(secure / insecure, 4) \
            if secure is not None and insecure else None
    ratios["master"] = {k: (master or {}).get(k) for k in MASTER_FIGURES}
    return ratios


def _ratio(a: Figure | None, b: Figure | None, field: str) -> float | None:
    return round(getattr(a, field) / getattr(b, field), 4) \
        if a and b and getattr(b, field) > 0 else None


def security_targets(ratios: dict) -> list[tuple[str, str, float]]:
    """The security-cost targets of the ratios measured both ways (--compare-insecure)."""
    bounds = [*((n, ">=", 1 - SECURITY_BOUND) for n, num, _ in RATIO_DEFINITIONS
                if num[0] == "kvpool"),
              *((n, "<=", 1 + SECURITY_BOUND) for n, *_ in SINGLE_P50_DEFINITIONS)]
    return [(f"{name}_secure_vs_plain", op, bound) for name, op, bound in bounds
            if ratios.get(f"{name}_secure_vs_plain") is not None]


# Targets set at a size of index: a smaller run's figure is shown, not judged (per object, the
# index's fixed costs weigh more at 1M objects: 315 bytes there, 293 at 10M).
TARGET_OBJECTS = {"master.bytes_per_object": 10_000_000}


def check_targets(ratios: dict, master_objects: int | None = None) -> list[dict]:
    """Each target with the measured value and whether it holds (None: not measured, or
    measured on a smaller index than its target's, ``master_objects``: ``at_objects`` then
    says which)."""
    out = []
    for name, op, bound in (*TARGETS, *security_targets(ratios)):
        value = ratios["master"].get(name.split(".", 1)[1]) if name.startswith("master.") \
            else ratios.get(name)
        met = None if value is None else (value >= bound if op == ">=" else value <= bound)
        t = {"name": name, "value": value, "op": op, "target": bound, "met": met}
        at = TARGET_OBJECTS.get(name)
        if at is not None and (master_objects or 0) < at:
            t.update(met=None, at_objects=at)
        out.append(t)
    return out


def build_report(figures: Sequence[Figure], master: dict | None, *, config: dict,
                 environment: dict, skipped: dict[str, str]) -> dict:
    ratios = compute_ratios(figures, master)
    return {"schema": SCHEMA, "config": config, "environment": environment,
            "results": [asdict(f) for f in figures], "master": master, "skipped": skipped,
            "ratios": ratios,
            "targets": check_targets(ratios, (master or {}).get("objects"))}


def validate_report(report: dict) -> list[str]:
    """Schema problems of a report (empty when valid); used by the tests and the CI smoke run."""
    problems = []
    for field in ("schema", "config", "environment", "results", "master", "skipped", "ratios",
                  "targets"):
        if field not in report:
            problems.append(f"missing {field!r}")
    if problems:
        return problems
    if report["schema"] != SCHEMA:
        problems.append(f"schema is {report['schema']!r}, expected {SCHEMA!r}")
    ratios = report["ratios"]
    for name in [n for n, *_ in RATIO_DEFINITIONS] + [n for n, *_ in SINGLE_P50_DEFINITIONS]:
        if name not in ratios:
            problems.append(f"ratios lacks {name!r}")
        elif ratios[name] is not None and not isinstance(ratios[name], (int, float)):
            problems.append(f"ratios[{name!r}] is not a number")
    master = ratios.get("master")
    if not isinstance(master, dict) or set(master) != set(MASTER_FIGURES):
        problems.append(f"ratios['master'] must have exactly {MASTER_FIGURES}")
    fields = set(Figure.__dataclass_fields__)
    for i, r in enumerate(report["results"]):
        if set(r) != fields:
            problems.append(f"results[{i}] fields differ: {sorted(set(r) ^ fields)}")
    return problems


# ---------------------------------------------------------------- the table


def format_table(report: dict) -> str:
    """The human summary: every figure, then the ratios against their targets."""
    header = (f"{'system':<12} {'via':<5} {'workload':<8} {'op':<4} {'value':>9} {'x':>4} "
              f"{'GB/s':>7} {'objects/s':>10} {'p50 ms':>8} {'p99 ms':>8}")
    lines = [header]
    for r in report["results"]:
        lines.append(
            f"{r['system']:<12} {r['transport']:<5} {r['workload']:<8} {r['op']:<4} "
            f"{_size(r['value_bytes']):>9} {r['objects_per_call']:>4} {r['gbps']:>7.2f} "
            f"{r['objects_per_s']:>10.0f} {r['p50_ms']:>8.2f} {r['p99_ms']:>8.2f}")
    m = report["master"]
    if m:
        lines.append("")
        memory = (f"{m['bytes_per_object']:.0f} bytes/object (RSS growth)"
                  if m["bytes_per_object"] is not None else "bytes/object not measured")
        lines.append(f"master: {m['objects']:,} objects indexed in batches of {m['batch']}: "
                     f"put {m['put_objects_per_s']:,.0f} objects/s, lookup "
                     f"{m['lookup_objects_per_s']:,.0f} objects/s (one client, call after call), "
                     f"{memory}")
        if m.get("clients"):
            lines.append(f"master kept busy by {m['clients']} clients at once: put "
                         f"{m['put_objects_per_s_concurrent']:,.0f} objects/s, lookup "
                         f"{m['lookup_objects_per_s_concurrent']:,.0f} objects/s")
    for what, why in report["skipped"].items():
        lines.append(f"skipped {what}: {why}")
    lines.append("")
    lines.append(f"{'target':<56} {'measured':>12} {'target':>12}  met")
    for t in report["targets"]:
        value = "-" if t["value"] is None else f"{t['value']:,.3f}".rstrip("0").rstrip(".")
        met = {True: "yes", False: "NO", None: "-"}[t["met"]]
        if "at_objects" in t:
            met += f" (its target is at {t['at_objects']:,} objects)"
        lines.append(f"{t['name']:<56} {value:>12} {t['op'] + ' ' + format(t['target'], 'g'):>12}"
                     f"  {met}")
    targeted = {t["name"] for t in report["targets"]}
    others = [(name, value) for name, value in report["ratios"].items()
              if name != "master" and name not in targeted and value is not None]
    if others:
        lines.append("")
        lines.append(f"{'other ratio':<56} {'measured':>12}")
        lines += [f"{name:<56} {value:>12.3f}" for name, value in others]
    return "\n".join(lines)


def _size(n: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


# ---------------------------------------------------------------- plots


def write_plots(report: dict, directory: Path) -> list[Path]:
    """Throughput and latency PNGs; returns their paths. Needs matplotlib (the bench extra)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    results = report["results"]
    paths = []

    batch = [r for r in results if r["workload"] in ("prompt", "small")]
    fig, ax = plt.subplots(figsize=(10, 5))
    labels = [f"{r['system']}\n{r['transport']} {r['op']}\n{r['workload']}" for r in batch]
    colors = {"kvpool": "tab:blue", "memcpy": "tab:gray", "raw_tcp": "tab:orange",
              "redis": "tab:red", "mooncake": "tab:purple"}
    ax.bar(range(len(batch)), [r["gbps"] for r in batch],
           color=[colors.get(r["system"], "tab:green") for r in batch])
    ax.set_xticks(range(len(batch)), labels, fontsize=7)
    ax.set_ylabel("GB/s (median)")
    ax.set_title("Batches: prompt = 256 x 2 MiB, small = 512 x 64 KiB")
    fig.tight_layout()
    paths.append(directory / "bench_batches.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    single = [r for r in results if r["workload"] == "single"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.5))
    series: dict[str, list[dict]] = {}
    for r in single:
        series.setdefault(f"{r['system']} {r['transport']} {r['op']}", []).append(r)
    for name, rows in sorted(series.items()):
        rows.sort(key=lambda r: r["value_bytes"])
        xs = [r["value_bytes"] / 1024 for r in rows]
        ax1.plot(xs, [r["gbps"] for r in rows], marker="o", label=name)
        ax2.plot(xs, [r["p50_ms"] for r in rows], marker="o", label=name)
    for ax, ylabel in ((ax1, "GB/s (median)"), (ax2, "p50 latency (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("value size (KiB)")
        ax.set_ylabel(ylabel)
    ax2.set_yscale("log")
    ax1.legend(fontsize=6)
    ax1.set_title("One value per call")
    fig.tight_layout()
    paths.append(directory / "bench_single.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths
