"""Fixtures for the compat tests: real clusters, Mooncake-API stores closed after each test, and
the engine venvs third-party code is driven in (with kvpool's ``mooncake`` shim first on its
path)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from kvpool.compat import SHIM_PATH
from kvpool.compat.mooncake import MooncakeDistributedStore
from kvpool.tools.cluster import LocalCluster

REPO = Path(__file__).resolve().parents[2]
ENV_BUILD_TIMEOUT_S = 1500


@pytest.fixture
def cluster(tmp_path):
    """``cluster(nodes=1, segment_size="64MiB")``: a real master and store nodes, stopped after
    the test, which fails if any of them logged a traceback."""
    made: list[LocalCluster] = []

    def start(nodes: int = 1, segment_size: str = "64MiB", master_args=()) -> LocalCluster:
        c = LocalCluster(nodes=nodes, segment_size=segment_size, master_args=list(master_args),
                         node_args=["--heartbeat-interval", "200ms"],
                         log_dir=tmp_path / f"cluster{len(made)}")
        made.append(c)
        c.start()
        return c

    yield start
    for c in made:
        c.stop()
    for log in tmp_path.glob("cluster*/*.log"):
        assert "Traceback" not in log.read_text(), f"traceback in {log.name}"


@pytest.fixture
def store():
    """``store(master, segment=0)``: a MooncakeDistributedStore set up on ``master`` with
    Mooncake's positional form; every one is closed after the test."""
    made: list[MooncakeDistributedStore] = []

    def start(master: str, segment=0) -> MooncakeDistributedStore:
        s = MooncakeDistributedStore()
        made.append(s)
        assert s.setup("127.0.0.1", "P2PHANDSHAKE", segment, 16 << 20, "tcp", "", master) == 0
        return s

    yield start
    for s in made:
        s.close()



def engine_python(script: str) -> str:
    """The Python that ``scripts/engines/<script>`` prints (building its venv the first time).
    Where it cannot be built (no PyPI) the test skips, saying so; under CI it fails."""
    try:
        r = subprocess.run(["bash", str(REPO / "scripts/engines" / script)], cwd=REPO,
                           capture_output=True, text=True, timeout=ENV_BUILD_TIMEOUT_S,
                           check=False)
        error = None if r.returncode == 0 else r.stderr[-3000:]
    except subprocess.TimeoutExpired:
        error = f"scripts/engines/{script} ran over {ENV_BUILD_TIMEOUT_S} s"
    if error is None:
        return r.stdout.strip().splitlines()[-1]
    message = f"scripts/engines/{script} could not build its venv (needs PyPI once):\n{error}"
    if os.environ.get("CI") == "true":
        pytest.fail(message)
    pytest.skip(message)


def shim_env(**extra: str) -> dict[str, str]:
    """This process's environment with the shim first on PYTHONPATH (then whatever was there:
    a developer's checkout of kvpool, if that is how this run imports it)."""
    path = [SHIM_PATH, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path), **extra}


@pytest.fixture
def shim():
    """``shim(**env)``: the environment for a child Python with the shim first on its path."""
    return shim_env


@pytest.fixture(scope="session")
def sglang_python() -> str:
    return engine_python("sglang-env.sh")


@pytest.fixture(scope="session")
def lmcache_python() -> str:
    return engine_python("lmcache-env.sh")
