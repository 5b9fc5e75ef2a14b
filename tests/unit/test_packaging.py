"""The installed package is what pyproject ships: every package folder of the repository, and none
of the developer scripts (scripts/, not installed), which nothing shipped may import."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
NOT_SHIPPED = ("tests", "scripts")
IMPORTS_UNSHIPPED = re.compile(rf"^\s*(from|import)\s+(kvpool\.)?({'|'.join(NOT_SHIPPED)})\b",
                               re.MULTILINE)


def _shipped_sources() -> list[Path]:
    """The .py files of the package folders (those with __init__.py) pyproject should ship."""
    tops = [REPO, *(d for d in REPO.iterdir() if (d / "__init__.py").exists()
                    and d.name not in NOT_SHIPPED)]
    files = list(REPO.glob("*.py"))
    for top in tops[1:]:
        files += [py for py in top.rglob("*.py") if (py.parent / "__init__.py").exists()]
    return files


@pytest.fixture(scope="module")
def wheel_files(tmp_path_factory) -> set[str]:
    # Built from a copy: setuptools writes build/ and *.egg-info beside the sources.
    src = tmp_path_factory.mktemp("src") / "kvpool"
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(
        ".git", "__pycache__", "*.so", "build", "*.egg-info", ".venv"))
    out = src.parent / "dist"
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                        "-q", "-w", str(out), str(src)],
                       capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    (whl,) = out.glob("kvpool-*.whl")
    with zipfile.ZipFile(whl) as z:
        return {n for n in z.namelist() if not n.split("/")[0].endswith(".dist-info")}


@pytest.mark.slow
def test_the_wheel_holds_every_package_and_no_developer_script(wheel_files):
    expected = {str(Path("kvpool", py.relative_to(REPO))) for py in _shipped_sources()}
    assert expected - wheel_files == set(), "package folders missing from pyproject's packages"
    assert "kvpool/tools/cli.py" in wheel_files and "kvpool/__main__.py" in wheel_files
    assert [n for n in wheel_files if n.split("/")[1] in NOT_SHIPPED] == []


def test_nothing_shipped_imports_tests_or_scripts():
    offenders = [str(py.relative_to(REPO)) for py in _shipped_sources()
                 if IMPORTS_UNSHIPPED.search(py.read_text())]
    assert offenders == []
