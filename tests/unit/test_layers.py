"""The import-linter layer contracts in pyproject.toml hold, and would catch an upward import."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("common", "net", "rpc", "protos", "master", "store_node", "client", "gateway",
            "embedded", "compat", "tools")


def _lint_imports(root: Path, package_parent: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command;"
         " sys.exit(lint_imports_command())", "--config", str(root / "pyproject.toml"),
         "--no-cache"],
        env={"PYTHONPATH": str(package_parent), "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, timeout=120)


def _copy_of_the_package(tmp_path: Path) -> Path:
    root = tmp_path / "kvpool"
    root.mkdir()
    for name in ("__init__.py", "pyproject.toml"):
        shutil.copy(REPO / name, root / name)
    for pkg in PACKAGES:
        shutil.copytree(REPO / pkg, root / pkg,
                        ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    return root


def test_the_layer_contracts_hold(tmp_path):
    root = _copy_of_the_package(tmp_path)
    r = _lint_imports(root, tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 broken" in r.stdout


def test_a_store_node_importing_the_client_breaks_the_layer_contract(tmp_path):
    root = _copy_of_the_package(tmp_path)
    with open(root / "store_node" / "manifest.py", "a") as f:
        f.write("\nfrom kvpool.client import KVClient  # noqa: E402,F401\n")
    r = _lint_imports(root, tmp_path)
    assert r.returncode != 0
    assert "kvpool layers" in r.stdout and "BROKEN" in r.stdout
    assert "kvpool.store_node.manifest -> kvpool.client" in r.stdout


def test_the_client_importing_the_gateway_breaks_the_layer_contract(tmp_path):
    root = _copy_of_the_package(tmp_path)
    with open(root / "client" / "router.py", "a") as f:
        f.write("\nfrom kvpool.gateway import engines  # noqa: E402,F401\n")
    r = _lint_imports(root, tmp_path)
    assert r.returncode != 0
    assert "kvpool.client.router -> kvpool.gateway" in r.stdout
