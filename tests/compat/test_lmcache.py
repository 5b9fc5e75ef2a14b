"""LMCache's own ``mooncakestore`` remote connector (lmcache 0.5.6, unmodified, from PyPI) on a
kvpool cluster through kvpool's ``mooncake`` shim: chunks put, found, and read back byte for
byte. LMCache's serving integration needs vLLM on a GPU; its storage classes run on CPU, so
``lmcache_driver.py`` drives the connector as LMCache's storage manager does (made by
``CreateConnector`` from a ``mooncakestore://`` URL, with LMCache's ``LocalCPUBackend`` memory
objects), under the LMCache venv's Python (scripts/engines/lmcache-env.sh)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

# The first test builds the engine's venv (minutes on a loaded host; pytest's default is 180 s).
pytestmark = pytest.mark.timeout(1500)

HERE = Path(__file__).resolve().parent
LMCACHE_VERSION = "0.5.6"
CHUNKS = 6   # the driver puts five of them (four batched, one alone); the sixth is never put


def drive(python: str, env: dict, master: str, mode: str, segment: str) -> dict:
    r = subprocess.run([python, str(HERE / "lmcache_driver.py"), master, mode, segment],
                       env=env, capture_output=True, text=True, timeout=300, check=False)
    lines = [line for line in r.stdout.splitlines() if line.startswith("DRIVER ")]
    assert r.returncode == 0 and lines, r.stdout[-2000:] + r.stderr[-3000:]
    answer = json.loads(lines[-1][len("DRIVER "):])
    assert "error" not in answer, answer.get("traceback", answer["error"])
    return answer


def test_the_installed_lmcache_is_the_tested_one(lmcache_python):
    r = subprocess.run([lmcache_python, "-W", "ignore", "-c",
                        "import lmcache, torch; print(lmcache.__version__, torch.__version__)"],
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split()[-2:] == [LMCACHE_VERSION, "2.13.0+cpu"]


@pytest.mark.parametrize(("mode", "segment"), [("zero-copy", "0"), ("meta", "32MB")])
def test_lmcaches_mooncakestore_connector_stores_and_reads_back_chunks(
        lmcache_python, shim, cluster, mode, segment):
    """``zero-copy``: LMCache's batch_put_from / put_from and batch_get_into; ``meta`` (its
    default, save_chunk_meta): put_parts and batch_get_buffer, here from a client that also
    contributes a 32 MB segment (global_segment_size)."""
    c = cluster()
    got = drive(lmcache_python, shim(), c.master, mode, segment)
    assert got["connector"] == ("lmcache.v1.storage_backend.connector.mooncakestore_connector."
                                "MooncakestoreConnector")
    assert got["store"] == "kvpool.compat.mooncake.MooncakeDistributedStore"
    assert got["exists_before"] == [False] * CHUNKS
    assert got["exists_after"] == [True] * 5 + [False]
    assert got["contains"] == 5
    assert got["read_back"] == [True] * 5 + [False]
    assert len(set(got["put"])) == CHUNKS   # different chunks, not one chunk six times
