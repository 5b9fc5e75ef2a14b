"""``kvpool soak``, bounded: load, eviction and node crashes (-9), also with master crashes (-9,
the index rebuilt from the nodes), on a real local cluster; then the audit (no wrong byte, no
lost or resurrected object, no leaked byte) must come out clean."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("faults", [
    pytest.param([], id="node-kills"),
    pytest.param(["--master-kill-interval", "8s"], id="node-and-master-kills"),
])
def test_soak_is_clean_under_kills_and_eviction(tmp_path, faults):
    out = tmp_path / "soak.json"
    proc = subprocess.run(
        [sys.executable, "-m", "kvpool", "soak", "--duration", "30s", "--clients", "3",
         "--nodes", "3", "--kill-interval", "5s", "--seed", "11", "--json", str(out),
         "--log-dir", str(tmp_path / "logs"), *faults],
        capture_output=True, text=True, timeout=150, check=False)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "audit: clean" in proc.stdout
    assert "s left" in proc.stdout   # progress lines while it runs
    r = json.loads(out.read_text())
    assert r["violations"] == []
    assert r["wrong_bytes"] == 0 and r["lost"] == 0 and r["resurrected"] == 0
    assert r["leaked_bytes"] == 0 and r["phantom_objects"] == 0 and r["hung_clients"] == 0
    # It must have been a soak: faults injected, eviction running, reads checked.
    assert r["node_kills"] >= 2
    assert r["master_kills"] >= (2 if faults else 0)
    assert r["evictions"] > 0
    assert r["counts"]["get_hit"] > 0 and r["final_checked"] > 0


def test_soak_refuses_more_replicas_than_nodes():
    proc = subprocess.run(
        [sys.executable, "-m", "kvpool", "soak", "--nodes", "2", "--max-replicas", "3"],
        capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2
    assert "more than the 2 nodes" in proc.stdout
    assert "Traceback" not in proc.stderr
