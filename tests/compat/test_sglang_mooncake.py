"""SGLang's own HiCache ``mooncake`` storage backend (sglang 0.5.23's ``MooncakeStore``,
unmodified) on a kvpool cluster through kvpool's ``mooncake`` shim.

SGLang's serving engine needs CUDA, so the backend is driven as its cache controller drives it,
with SGLang's own classes: ``StorageBackendFactory.create_backend("mooncake", ...)`` makes it
(its setup, warm-up put, ``is_exist`` and ``get`` included), ``register_mem_pool_host`` hands it
an ``MHATokenToKVPoolHost`` / ``MLATokenToKVPoolHost`` over a CPU device pool (registering the
pool's memory by address), and pages move with ``batch_set_v1`` / ``batch_get_v1``
(``batch_put_from`` / ``batch_get_into``, or their multi-buffer forms for MLA's layer_first
layout) and are counted with ``batch_exists`` (``batch_is_exist``). The driver is
tests/engines/sglang_driver.py, run by the SGLang venv's Python (scripts/engines/sglang-env.sh)
with the shim first on its path.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

import pytest
from kvpool.client import KVClient

DRIVER = Path(__file__).resolve().parents[1] / "engines" / "sglang_driver.py"


class Driver:
    """One sglang_driver.py process; ``ok(op, **args)`` returns its answer to one request."""

    def __init__(self, python: str, env: dict, log: Path):
        self._log = open(log, "w")   # noqa: SIM115  (closed by close())
        self.log = log
        self.proc = subprocess.Popen([python, str(DRIVER)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._log, text=True,
                                     bufsize=1, env=env)

    def ok(self, op: str, **args) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()
        for line in self.proc.stdout:   # the driver answers every request, even with an error
            if line.startswith("DRIVER "):
                answer = json.loads(line[len("DRIVER "):])
                assert "error" not in answer, answer.get("traceback", answer["error"])
                return answer
        raise AssertionError(f"driver exited ({self.proc.wait()}): {self.log.read_text()[-3000:]}")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._log.close()


@pytest.fixture
def driver(sglang_python, shim, tmp_path):
    made: list[Driver] = []

    def start() -> Driver:
        d = Driver(sglang_python, shim(), tmp_path / f"driver{len(made)}.log")
        made.append(d)
        return d

    yield start
    for d in made:
        d.close()


def pages(n: int, tag: str) -> list[str]:
    return [hashlib.sha256(f"{tag}{i}".encode()).hexdigest() for i in range(n)]


def mooncake_config(master: str, segment) -> dict:
    # As a deployment's --hicache-storage-backend-extra-config for the mooncake backend.
    return {"master_server_address": master, "local_hostname": "127.0.0.1",
            "metadata_server": "P2PHANDSHAKE", "protocol": "tcp", "device_name": "",
            "global_segment_size": segment, "check_server": False}


@pytest.mark.parametrize(("layout", "mla", "segment"), [
    ("page_first", False, 0),          # MHA: a k and a v object per page
    ("page_first_direct", False, 0),
    ("layer_first", True, 32 << 20),   # MLA: a page's layers gathered from several buffers
])
def test_sglangs_mooncake_backend_stores_pages_in_kvpool_byte_for_byte(
        driver, cluster, layout, mla, segment):
    c, d = cluster(), driver()
    d.ok("pool", layout=layout, pages=32, mla=mla)
    made = d.ok("backend", extra=mooncake_config(c.master, segment), backend="mooncake", mla=mla)
    assert made["class"].endswith("mooncake_store.MooncakeStore"), made
    keys = pages(6, layout)
    d.ok("fill", pages=list(range(6)), seed=1)
    assert d.ok("exists", keys=keys)["count"] == 0
    assert d.ok("set_v1", keys=keys[:4], pages=list(range(4)))["ok"] == [True] * 4
    assert d.ok("exists", keys=keys)["count"] == 4   # the stored prefix
    # SGLang skips pages already stored; a second set reports them stored.
    assert d.ok("set_v1", keys=keys, pages=list(range(6)))["ok"] == [True] * 6
    assert d.ok("get_v1", keys=keys, pages=list(range(10, 16)))["ok"] == [True] * 6
    want = d.ok("digest", pages=list(range(6)))["digests"]
    assert d.ok("digest", pages=list(range(10, 16)))["digests"] == want
    assert len(set(want)) == 6
    assert d.ok("get_v1", keys=pages(2, "never"), pages=[20, 21])["ok"] == [False, False]
    with KVClient(c.master) as kv:   # the pages are kvpool objects (and the warm-up value)
        objects = kv.stats().objects
    assert objects >= 6 * (1 if mla else 2)
