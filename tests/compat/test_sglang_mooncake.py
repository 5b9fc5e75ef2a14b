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
import queue
import subprocess
import threading
from pathlib import Path

import pytest
from kvpool.client import KVClient

# The first test builds the engine's venv (minutes on a loaded host; pytest's default is 180 s).
pytestmark = pytest.mark.timeout(1500)

DRIVER = Path(__file__).resolve().parents[1] / "engines" / "sglang_driver.py"


class Driver:
    """One sglang_driver.py process; ``ok(op, **args)`` returns its answer to one request."""

    def __init__(self, python: str, env: dict, log: Path):
        self._log = open(log, "w")   # noqa: SIM115  (closed by close())
        self.log = log
        self.proc = subprocess.Popen([python, str(DRIVER)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._log, text=True,
                                     bufsize=1, env=env)
        self._answers: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("DRIVER "):
                self._answers.put(line[len("DRIVER "):])
        self._answers.put(None)

    def ok(self, op: str, timeout_s: float = 120, **args) -> dict:
        """The driver's answer (it answers every request, an exception too: then this fails
        with its traceback)."""
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()
        try:
            line = self._answers.get(timeout=timeout_s)
        except queue.Empty:
            raise AssertionError(f"driver silent for {timeout_s} s on {op}; log tail:\n"
                                 + self.log.read_text()[-3000:]) from None
        if line is None:
            raise AssertionError(f"driver exited ({self.proc.wait()}) on {op}; log tail:\n"
                                 + self.log.read_text()[-3000:])
        answer = json.loads(line)
        assert "error" not in answer, f"{op}: {answer.get('traceback', answer['error'])}\n" \
            f"log tail:\n{self.log.read_text()[-2000:]}"
        return answer

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
