"""``kvpool bench --compat`` end to end on a tiny workload: every system's bytes come back
whole and the report holds every figure (not the speed: this host's load decides that)."""

from __future__ import annotations

import json

from kvpool.tools.bench_compat import Shape, run_compat_bench
from kvpool.tools.bench_mooncake import why_unavailable


def test_the_compat_bench_reports_native_compat_and_mooncake(tmp_path, capsys):
    out = tmp_path / "compat.json"
    run_compat_bench(repeats=2, json_path=str(out), shapes=(Shape("tiny", 8, 64 << 10),))
    report = json.loads(out.read_text())
    table = capsys.readouterr().out
    assert "compat within 10% of native on every line" in table
    assert [(r["transport"], r["shape"]) for r in report["results"]] == [("shm", "tiny"),
                                                                         ("tcp", "tiny")]
    mooncake = not why_unavailable()
    for r in report["results"]:
        systems = {"native", "compat"} | ({"mooncake"} if mooncake and r["transport"] == "tcp"
                                          else set())
        assert set(r["gbps"]) == {f"{s} {op}" for s in systems for op in ("put", "get")}
        assert all(v > 0 for v in r["gbps"].values())
        assert set(r["compat_vs_native"]) == {"put", "get"}
        assert all(len(v) == 2 for v in r["seconds"].values())
    assert report["met"] == all(min(r["compat_vs_native"].values()) >= 0.9
                                for r in report["results"])
    if not mooncake:
        assert "mooncake" in report["skipped"]
