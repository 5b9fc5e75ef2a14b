"""deploy/prometheus: the alert rules load (promtool check rules) and fire exactly where their
unit tests say (promtool test rules); promtool is Debian's `prometheus`, which
`bash scripts/setup.sh --tests` installs (it starts no server)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

RULES = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"


@pytest.fixture(scope="module")
def promtool() -> str:
    path = shutil.which("promtool")
    assert path, "promtool is missing: run `bash scripts/setup.sh --tests` (Debian prometheus)"
    return path


@pytest.mark.parametrize("command", [["check", "rules", "kvpool-alerts.yml"],
                                     ["test", "rules", "kvpool-alerts.test.yml"]],
                         ids=["check", "unit-tests"])
def test_alert_rules(promtool, command):
    r = subprocess.run([promtool, *command], cwd=RULES, capture_output=True, text=True,
                       timeout=60, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout
