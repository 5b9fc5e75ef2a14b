"""``kvpool bench`` over rdma: where a device exists the bench measures the rdma transport beside
shm and tcp. Runs for real in the soft-RoCE VM (``bash scripts/softroce/test.sh``); the figures
are emulated there, so only the report is checked, not the speed."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from kvpool.tools.bench_report import validate_report

pytestmark = pytest.mark.rdma


def test_bench_measures_the_rdma_transport(tmp_path, report_figure):
    out = tmp_path / "bench.json"
    r = subprocess.run(
        [sys.executable, "-m", "kvpool", "bench", "--quick", "--transports", "rdma",
         "--sizes", "64KiB", "--single-calls", "2", "--prompt-blocks", "8", "--block-size",
         "1MiB", "--small-blocks", "16", "--small-size", "16KiB", "--no-redis",
         "--no-master-bench", "--json", str(out)],
        capture_output=True, text=True, timeout=280, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(out.read_text())
    assert validate_report(report) == []
    assert "kvpool-rdma" not in report["skipped"]
    rdma = {(f["workload"], f["op"]): f for f in report["results"]
            if f["system"] == "kvpool" and f["transport"] == "rdma"}
    assert set(rdma) == {(w, op) for w in ("single", "prompt", "small") for op in ("put", "get")}
    assert all(f["gbps"] > 0 for f in rdma.values())
    report_figure("bench rdma prompt get (8 x 1 MiB)", rdma[("prompt", "get")]["gbps"] * 1e3,
                  "MB/s")
