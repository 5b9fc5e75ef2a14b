"""``kvpool replay --calibrate`` and ``--sweep`` on the real trace's head."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from kvpool.master.calibration import Rates
from kvpool.tools.replay_sim import InstanceModel, load_trace, model_rates, simulate

TRACE = Path(__file__).parents[1] / "data" / "mooncake_conversation_trace_head.jsonl"


def replay(*args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvpool", "replay", *args, "--no-progress"],
                          capture_output=True, text=True, check=False, timeout=timeout)


def test_calibrate_converges_from_four_times_off_on_the_trace_head(tmp_path):
    out, png = tmp_path / "c.json", tmp_path / "c.png"
    r = replay(str(TRACE), "--calibrate", "--json", str(out), "--plot", str(png))
    assert r.returncode == 0, r.stderr
    report = json.loads(out.read_text())
    base = report["configured"]["ttft_p90_s"]
    starts = [f"prefill x{p}, store x{s}" for p in ("4", "1/4") for s in ("4", "1/4")]
    assert set(report) == {"configured"} | {f"{s}, {how}" for s in starts
                                            for how in ("fixed", "calibrated")}
    for start in starts:
        fixed, cal = report[f"{start}, fixed"], report[f"{start}, calibrated"]
        assert cal["ttft_p90_s"] == pytest.approx(base, rel=0.05), start
        # A fixed model keeps its error; a calibrated one learns prefill within 5% in the first
        # tens of requests, and the store rate (few requests load much from it in the head)
        # most of the way.
        assert fixed["rates_at_end"] == pytest.approx([4 if "x4," in start else 0.25,
                                                       4 if start.endswith("x4") else 0.25])
        prefill, store = cal["rates_at_end"]
        assert prefill == pytest.approx(1, abs=0.05), start
        assert store == pytest.approx(1, abs=0.1), start
        assert cal["converged_after"][0] < 100
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "prefill x4, store x1/4, calibrated" in r.stdout


def test_calibrating_from_the_right_rates_stays_there():
    """Jittered service times and FIFO-derived samples do not walk a correct model away."""
    reqs = load_trace(TRACE)
    model = InstanceModel(1 / 4000, 1 / 40000)
    sim = {"instances": 8, "cache_blocks": 1000, "store_blocks": 5000, "model": model,
           "service_jitter": 0.2}
    history: list = []
    simulate(reqs, "kvpool", calibrate=True, history=history, **sim)
    truth = model_rates(model)
    for _, rates in history[len(history) // 4:]:
        for r in rates.values():
            assert r.prefill_tokens_per_s == pytest.approx(truth.prefill_tokens_per_s, rel=0.1)
            assert r.store_tokens_per_s == pytest.approx(truth.store_tokens_per_s, rel=0.25)
    assert all(isinstance(r, Rates) for r in history[-1][1].values())


def test_sweep_checks_the_targets(tmp_path):
    out = tmp_path / "s.json"
    r = replay(str(TRACE), "--sweep", "8000,4000", "--policies", "least_loaded,kvpool",
               "--json", str(out))
    assert r.returncode == 0, r.stderr
    points = json.loads(out.read_text())
    assert [(p["prefill_tokens_per_s"], p["store_blocks"]) for p in points] == \
        [(8000, 60000), (8000, 0), (4000, 60000), (4000, 0)]
    for p in points:
        assert set(p["p90_s"]) == {"least_loaded", "kvpool"} and p["ratio"] <= 1.02
        assert p["floor_p90_s"] < p["p90_s"][p["best"]]
    assert "target (default p90 within 2% of the best" in r.stdout and "): met" in r.stdout
    assert "less prefill" in r.stdout


@pytest.mark.parametrize("args, rc, message", [
    (["--sweep", "fast"], 2, "invalid list 'fast'"),
    (["--calibrate-factors", "4,-1"], 2, "invalid list"),
    (["--calibrate", "--service-jitter", "1.5"], 1, "--service-jitter must be in [0, 1)"),
])
def test_bad_study_flags_are_explained(args, rc, message):
    r = replay(str(TRACE), *args, timeout=60)
    assert r.returncode == rc and message in r.stderr and "Traceback" not in r.stderr
