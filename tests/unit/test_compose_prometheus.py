"""deploy/compose/prometheus.yml: a config Prometheus loads, with the alert rules, scraping the
compose services as the jobs those rules name (promtool: Debian's `prometheus`, which
`bash scripts/setup.sh --tests` installs)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import yaml

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
RULES_IN_CONTAINER = "/etc/prometheus/kvpool-alerts.yml"   # compose.yaml mounts them there


def test_the_compose_scrape_config_loads_with_the_alert_rules(tmp_path):
    promtool = shutil.which("promtool")
    assert promtool, "promtool is missing: run `bash scripts/setup.sh --tests` (Debian prometheus)"
    text = (DEPLOY / "compose" / "prometheus.yml").read_text()
    assert RULES_IN_CONTAINER in text
    config = tmp_path / "prometheus.yml"
    config.write_text(text.replace(RULES_IN_CONTAINER,
                                   str(DEPLOY / "prometheus" / "kvpool-alerts.yml")))
    r = subprocess.run([promtool, "check", "config", str(config)], capture_output=True, text=True,
                       timeout=60, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS: 1 rule files found" in r.stdout

    jobs = {j["job_name"]: j["static_configs"][0]["targets"]
            for j in yaml.safe_load(text)["scrape_configs"]}
    compose = yaml.safe_load((DEPLOY / "compose" / "compose.yaml").read_text())["services"]
    assert jobs == {"kvpool-master": ["master-a:9400", "master-b:9410"],
                    "kvpool-store-node": ["node-1:9401", "node-2:9411"]}
    for target in jobs["kvpool-master"] + jobs["kvpool-store-node"]:
        service, port = target.split(":")
        assert ["--metrics-port", port] == _option(compose[service]["command"], "--metrics-port")


def _option(command: list[str], name: str) -> list[str]:
    i = command.index(name)
    return command[i:i + 2]
