"""deploy/systemd: each unit starts kvpool with arguments kvpool's own parser accepts, with
credentials and never --insecure, says how to make those credentials, and passes
`systemd-analyze verify` where systemd is installed."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

UNITS = Path(__file__).resolve().parents[2] / "deploy" / "systemd"
ENV = {"KVPOOL_ADVERTISE_HOST": "10.0.0.12", "KVPOOL_SEGMENT_SIZE": "32GiB"}


def unit(name: str) -> tuple[str, dict[str, list[str]]]:
    """The unit's text and its settings (continuation lines joined; comments dropped)."""
    text = (UNITS / name).read_text()
    settings: dict[str, list[str]] = {}
    for line in text.replace("\\\n", " ").splitlines():
        if "=" in line and not line.startswith(("#", ";", "[")):
            key, _, value = line.partition("=")
            settings.setdefault(key.strip(), []).append(value.strip())
    return text, settings


@pytest.mark.parametrize("name, command, creds", [
    ("kvpool-master.service", "master", "/etc/kvpool/master-creds.yaml"),
    ("kvpool-store-node.service", "store-node", "/etc/kvpool/node-creds.yaml"),
])
def test_units_run_kvpool_with_credentials(name, command, creds, monkeypatch):
    from kvpool.tools.cli import build_parser
    # The store node's unit takes the master from its EnvironmentFile.
    monkeypatch.setenv("KVPOOL_MASTER", "10.0.0.1:50051")
    text, settings = unit(name)
    [exec_start] = settings["ExecStart"]
    argv = shlex.split(re.sub(r"\$\{(\w+)\}", lambda m: ENV[m.group(1)], exec_start))
    assert argv[:2] == ["/usr/bin/env", "kvpool"] and argv[2] == command
    parser, _ = build_parser(command)
    args = parser.parse_args(argv[2:])
    assert args.credentials == creds
    assert not getattr(args, "insecure", False)
    # The unit's dynamic user reads the credentials through the group they are given to.
    assert settings["DynamicUser"] == ["yes"] and settings["SupplementaryGroups"] == ["kvpool"]
    # The comments say how to make them, and where they go.
    assert "kvpool credentials" in text and "-g kvpool" in text
    assert text.count(creds) >= 2


def test_the_master_units_recipe_is_a_command_kvpool_accepts():
    from kvpool.tools.cli import build_parser
    text, _ = unit("kvpool-master.service")
    recipe = re.search(r"#   (kvpool credentials .*?)\n# then", text, re.DOTALL).group(1)
    recipe = re.sub(r"\\\n#\s*", " ", recipe).replace("THIS_HOST_IP", "10.0.0.5")
    argv = shlex.split(recipe.replace(" ... ", " "))[1:]
    parser, _ = build_parser("credentials")
    args = parser.parse_args(argv)
    assert args.master and args.node == ["node0"] and args.export == "/root/kvpool-out"


@pytest.mark.parametrize("name", ["kvpool-master.service", "kvpool-store-node.service"])
def test_systemd_accepts_the_units(name, tmp_path):
    analyze = shutil.which("systemd-analyze")
    if not analyze:
        pytest.skip("systemd-analyze is not installed")
    shutil.copy(UNITS / name, tmp_path / name)
    r = subprocess.run([analyze, "verify", str(tmp_path / name)], capture_output=True,
                       text=True, timeout=60, check=False)
    assert r.returncode == 0 and not r.stderr.strip(), r.stderr
