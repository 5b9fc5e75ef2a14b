"""``kvpool replay --live`` against a real local cluster: real bytes, every read verified."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

TRACE = Path(__file__).parents[1] / "data" / "mooncake_conversation_trace_head.jsonl"


def write_trace(path: Path) -> Path:
    """6 conversations whose turns extend their previous turn's blocks: taken in turn by 4
    instances, a turn often lands where its prefix is not local but in the store."""
    lines, hist = [], {}
    for i in range(60):
        c = i % 6
        h = hist.setdefault(c, [1000 * c])
        h.append(1000 * c + len(h))
        lines.append(json.dumps({"timestamp": 0, "input_length": 512 * len(h),
                                 "output_length": 1, "hash_ids": list(h)}))
    path.write_text("\n".join(lines) + "\n")
    return path


def replay(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvpool", "replay", *args],
                          capture_output=True, text=True, check=False, timeout=120)


def test_live_replay_reads_back_what_it_stored(cluster, tmp_path):
    out = tmp_path / "live.json"
    r = replay(str(write_trace(tmp_path / "t.jsonl")), "--live", "--master", cluster.master,
               "--instances", "4", "--requests", "60", "--policies", "round_robin",
               "--json", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    live = json.loads(out.read_text())["live"]
    assert live["requests"] == 60 and live["mismatches"] == 0 and live["put_errors"] == 0
    assert live["store_hit_blocks"] > 0 and live["local_hit_blocks"] > 0
    assert live["store_hit_blocks"] == live["expected_store_blocks"]
    assert live["bytes_verified"] == live["store_hit_blocks"] * 16384
    assert "0 mismatches" in r.stdout


def test_live_replay_of_the_mooncake_trace_prefix(cluster, tmp_path):
    r = replay(str(TRACE), "--live", "--master", cluster.master, "--requests", "40")
    assert r.returncode == 0 and "0 mismatches" in r.stdout, r.stdout + r.stderr


def test_live_replay_needs_a_master(tmp_path):
    r = replay(str(write_trace(tmp_path / "t.jsonl")), "--live")
    assert r.returncode == 1 and "--live needs --master" in r.stderr
    assert "Traceback" not in r.stderr


def test_replay_through_a_gateway_that_is_not_there_is_a_clear_error(tmp_path):
    r = replay(str(TRACE), "--gateway", "http://127.0.0.1:9", "--requests", "2")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "gateway http://127.0.0.1:9 does not answer" in r.stderr
