"""kvpool's SGLang HiCache storage backend (client/connectors/sglang.py) against the real
``sglang`` package and a real kvpool cluster.

SGLang's serving engine needs CUDA, so the backend is driven the way SGLang's cache controller
drives it, with SGLang's own classes: ``StorageBackendFactory.create_backend("dynamic", ...)``
loads it by module path, ``register_mem_pool_host`` hands it an ``MHATokenToKVPoolHost`` (or
``MLATokenToKVPoolHost``) built over a CPU device pool, and pages move with the calls the
controller makes (``batch_exists``, ``batch_set_v1``/``batch_get_v1`` with ``interface_v1``,
``batch_set``/``batch_get`` of flat pages without). Each test talks to ``sglang_driver.py``
running under the SGLang venv's Python (scripts/engines/sglang-env.sh, built once and cached).
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import threading
import time
from pathlib import Path

import pytest
from kvpool.tools.cluster import LocalCluster

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
ENV_BUILD_TIMEOUT_S = 1500
SGLANG_VERSION = "0.5.23"
# The first test builds the engine's venv (minutes on a loaded host; pytest's default is 180 s).
pytestmark = pytest.mark.timeout(ENV_BUILD_TIMEOUT_S)
BACKEND = {"backend_name": "kvpool", "module_path": "kvpool.client.connectors.sglang",
           "class_name": "KVPoolHiCacheStorage"}


@pytest.fixture(scope="session")
def sglang_python() -> str:
    """The Python of the SGLang venv, with this checkout's kvpool installed in it. Where the
    venv cannot be built (no PyPI) the tests skip, saying so; under CI they fail."""
    try:
        r = subprocess.run(["bash", str(REPO / "scripts/engines/sglang-env.sh")], cwd=REPO,
                           capture_output=True, text=True, timeout=ENV_BUILD_TIMEOUT_S,
                           check=False)
        error = None if r.returncode == 0 else r.stderr[-3000:]
    except subprocess.TimeoutExpired:
        error = f"scripts/engines/sglang-env.sh ran over {ENV_BUILD_TIMEOUT_S} s"
    if error is None:
        return r.stdout.strip().splitlines()[-1]
    message = f"the SGLang venv could not be built (needs PyPI the first time):\n{error}"
    if os.environ.get("CI") == "true":
        pytest.fail(message)
    pytest.skip(message)


class Driver:
    """One ``sglang_driver.py`` process; ``ask(op, **args)`` returns its answer."""

    def __init__(self, python: str, log_path: Path):
        self._log = open(log_path, "a")   # noqa: SIM115  (closed by close())
        self.log_path = log_path
        self.proc = subprocess.Popen([python, str(HERE / "sglang_driver.py")],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._log, text=True, bufsize=1)
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self._lines.put(line.rstrip("\n"))
        self._lines.put(None)

    def ask(self, op: str, timeout_s: float = 120, **args) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self._lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"driver silent for {timeout_s} s on {op}; log: "
                                     f"{self.log_path}") from None
            if line is None:
                raise AssertionError(f"driver exited ({self.proc.wait()}); log tail:\n"
                                     + self.log_path.read_text()[-4000:])
            if line.startswith("DRIVER "):
                return json.loads(line[len("DRIVER "):])

    def ok(self, op: str, **args) -> dict:
        """``ask``, asserting the call raised nothing."""
        answer = self.ask(op, **args)
        assert "error" not in answer, answer.get("traceback", answer["error"])
        return answer

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.ask("close", timeout_s=30)
                self.proc.wait(30)
            except (AssertionError, OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self._log.close()


@pytest.fixture
def driver(sglang_python, tmp_path):
    """``driver()`` starts a driver process; all are stopped after the test."""
    started: list[Driver] = []

    def start() -> Driver:
        d = Driver(sglang_python, tmp_path / f"driver{len(started)}.log")
        started.append(d)
        return d

    yield start
    for d in started:
        d.close()


@pytest.fixture
def cluster(tmp_path):
    """``cluster(segment_size=...)``: a real master and one store node, stopped after the test,
    which fails if any of them logged a traceback."""
    made: list[LocalCluster] = []

    def start(segment_size: str = "64MiB") -> LocalCluster:
        c = LocalCluster(nodes=1, segment_size=segment_size,
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


def pages(n: int, tag: str = "p") -> list[str]:
    """``n`` page hashes shaped like SGLang's (64 hex digits), distinct per ``tag``."""
    import hashlib
    return [hashlib.sha256(f"{tag}{i}".encode()).hexdigest() for i in range(n)]


def backend(d: Driver, master: str, *, layout: str = "page_first", v1: bool = True,
            pool_pages: int = 32, mla: bool = False, tp_rank: int = 0, tp_size: int = 1,
            **extra) -> dict:
    d.ok("pool", layout=layout, pages=pool_pages, mla=mla)
    config = {**BACKEND, "master": master, **extra}
    if v1:
        config["interface_v1"] = 1
    return d.ask("backend", extra=config, mla=mla, tp_rank=tp_rank, tp_size=tp_size)


def test_the_installed_sglang_is_the_tested_one_with_its_storage_interface(sglang_python):
    r = subprocess.run([sglang_python, "-W", "ignore", "-c", """
import sglang, torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage
from sglang.srt.mem_cache.pool_host import HostKVCache
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from kvpool.client.connectors.sglang import KVPoolHiCacheStorage

assert issubclass(KVPoolHiCacheStorage, HiCacheStorage)
assert issubclass(MHATokenToKVPoolHost, HostKVCache)
print(sglang.__version__, torch.__version__)"""], capture_output=True, text=True, timeout=120,
                       check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == [SGLANG_VERSION, "2.13.0+cpu"]


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct", "page_head"])
def test_pages_go_to_the_store_and_back_byte_for_byte_zero_copy(driver, cluster, layout):
    c, d = cluster(), driver()
    made = backend(d, c.master, layout=layout)
    assert made["class"] == "kvpool.client.connectors.sglang.KVPoolHiCacheStorage", made
    assert any("zero_copy=True" in line for line in made["logs"]), made["logs"]
    keys = pages(6)
    d.ok("fill", pages=list(range(6)), seed=1)
    assert d.ok("set_v1", keys=keys, pages=list(range(6)))["ok"] == [True] * 6
    assert d.ok("exists", keys=keys)["count"] == 6
    # Read into another region of the pool: every page as it was written.
    assert d.ok("get_v1", keys=keys, pages=list(range(10, 16)))["ok"] == [True] * 6
    want = d.ok("digest", pages=list(range(6)))["digests"]
    assert d.ok("digest", pages=list(range(10, 16)))["digests"] == want
    assert len(set(want)) == 6   # six different pages, not one page six times

    # A second set of the same pages is harmless: reported stored, the objects unchanged.
    d.ok("fill", pages=list(range(6)), seed=2)
    assert d.ok("set_v1", keys=keys, pages=list(range(6)))["ok"] == [True] * 6
    d.ok("zero", pages=list(range(10, 16)))
    assert d.ok("get_v1", keys=keys, pages=list(range(10, 16)))["ok"] == [True] * 6
    assert d.ok("digest", pages=list(range(10, 16)))["digests"] == want


def test_exists_counts_the_stored_prefix_and_missing_pages_fail_to_load(driver, cluster):
    c, d = cluster(), driver()
    backend(d, c.master)
    keys = pages(5)
    d.ok("fill", pages=list(range(5)))
    # Pages 0, 1, 3, 4 stored; 2 is not (SGLang asks for a prefix: 2 stops it).
    stored = [0, 1, 3, 4]
    assert d.ok("set_v1", keys=[keys[i] for i in stored], pages=stored)["ok"] == [True] * 4
    assert d.ok("exists", keys=keys)["count"] == 2
    assert d.ok("exists", keys=keys[3:])["count"] == 2
    assert d.ok("exists", keys=pages(3, "never"))["count"] == 0
    assert d.ok("exists", keys=[])["count"] == 0
    d.ok("zero", pages=[20, 21, 22])
    got = d.ok("get_v1", keys=keys[1:4], pages=[20, 21, 22])["ok"]
    assert got == [True, False, True]
    # The missing page's region is left as it was, and so is the batch's report: no exception.
    assert d.ok("digest", pages=[21])["digests"] == d.ok("digest", pages=[23])["digests"]


def test_the_copying_path_and_the_zero_copy_path_store_the_same_objects(driver, cluster):
    """Without ``interface_v1`` SGLang copies flat pages (get_data_page); with it the backend
    reads the pool's regions in place. Either reads what the other wrote."""
    c = cluster()
    a, b = driver(), driver()
    backend(a, c.master, v1=True)
    backend(b, c.master, v1=False)
    a.ok("fill", pages=[0, 1, 2], seed=3)
    b.ok("fill", pages=[0, 1, 2], seed=4)
    ka, kb = pages(3, "a"), pages(3, "b")
    assert a.ok("set_v1", keys=ka, pages=[0, 1, 2])["ok"] == [True] * 3
    assert b.ok("set", keys=kb, pages=[0, 1, 2])["ok"] is True
    assert b.ok("get", keys=ka, pages=[8, 9, 10])["ok"] == [True] * 3
    assert a.ok("get_v1", keys=kb, pages=[8, 9, 10])["ok"] == [True] * 3
    assert b.ok("digest", pages=[8, 9, 10])["digests"] == a.ok("digest", pages=[0, 1, 2])["digests"]
    assert a.ok("digest", pages=[8, 9, 10])["digests"] == b.ok("digest", pages=[0, 1, 2])["digests"]
    assert b.ok("exists", keys=ka)["count"] == 3
    assert b.ok("get", keys=pages(1, "none"), pages=[11])["ok"] == [False]


def test_layer_first_is_stored_through_the_copying_path_and_refused_zero_copy(driver, cluster):
    c = cluster()
    d = driver()
    made = backend(d, c.master, layout="layer_first", v1=True)
    assert "NotImplementedError" in made["error"] and "layer_first" in made["error"] \
        and "page_first" in made["error"], made
    d = driver()
    made = backend(d, c.master, layout="layer_first", v1=False)
    assert any("zero_copy=False" in line for line in made["logs"]), made["logs"]
    d.ok("fill", pages=[0, 1])
    keys = pages(2, "lf")
    assert d.ok("set", keys=keys, pages=[0, 1])["ok"] is True
    assert d.ok("get", keys=keys, pages=[5, 6])["ok"] == [True, True]
    assert d.ok("digest", pages=[5, 6])["digests"] == d.ok("digest", pages=[0, 1])["digests"]
    # Another layout's bytes are in another namespace: a page_first pool does not see them.
    other = driver()
    backend(other, c.master, layout="page_first")
    assert other.ok("exists", keys=keys)["count"] == 0


def test_each_tp_rank_has_its_namespace_but_mla_kv_is_shared(driver, cluster):
    c = cluster()
    r0, r1 = driver(), driver()
    backend(r0, c.master, tp_rank=0, tp_size=2)
    backend(r1, c.master, tp_rank=1, tp_size=2)
    keys = pages(2, "tp")
    r0.ok("fill", pages=[0, 1])
    assert r0.ok("set_v1", keys=keys, pages=[0, 1])["ok"] == [True, True]
    assert r1.ok("exists", keys=keys)["count"] == 0
    assert r1.ok("get_v1", keys=keys, pages=[0, 1])["ok"] == [False, False]

    m0, m1 = driver(), driver()
    made = backend(m0, c.master, mla=True, tp_rank=0, tp_size=2)
    assert any("zero_copy=True" in line for line in made["logs"]), made
    backend(m1, c.master, mla=True, tp_rank=1, tp_size=2)
    m0.ok("fill", pages=[0, 1], seed=5)
    assert m0.ok("set_v1", keys=keys, pages=[0, 1])["ok"] == [True, True]
    assert m1.ok("exists", keys=keys)["count"] == 2
    assert m1.ok("get_v1", keys=keys, pages=[4, 5])["ok"] == [True, True]
    assert m1.ok("digest", pages=[4, 5])["digests"] == m0.ok("digest", pages=[0, 1])["digests"]


def test_bad_configuration_is_refused_with_a_clear_message(driver, cluster):
    d = driver()
    d.ok("pool")
    no_master = d.ask("backend", extra={**BACKEND, "interface_v1": 1})
    assert "ValueError" in no_master["error"] and '"master"' in no_master["error"], no_master
    bad = d.ask("backend", extra={**BACKEND, "master": "127.0.0.1:1", "timeout_s": "soon"})
    assert "timeout_s must be a number, not 'soon'" in bad["error"], bad
    wrong_class = d.ask("backend", extra={**BACKEND, "class_name": "NoSuchClass",
                                          "master": "127.0.0.1:1"})
    assert "NoSuchClass" in wrong_class["error"], wrong_class
    typo = d.ok("backend", extra={**BACKEND, "master": "127.0.0.1:1", "replica": 2})
    assert any("kvpool_unknown_options ['replica']" in line for line in typo["logs"]), typo


def test_a_store_that_goes_down_reports_failures_and_never_hangs(driver, cluster):
    c, d = cluster(), driver()
    backend(d, c.master, timeout_s=2, retry_s=30)
    keys = pages(4, "down")
    d.ok("fill", pages=[0, 1, 2, 3])
    assert d.ok("set_v1", keys=keys, pages=[0, 1, 2, 3])["ok"] == [True] * 4
    c.stop()
    first = d.ok("exists", keys=keys)
    assert first["count"] == 0 and first["s"] < 30, first
    assert any("kvpool_unavailable" in line for line in first["logs"]), first["logs"]
    # While the store counts as down, every call answers at once, and logs nothing more.
    for op, args in [("get_v1", {"pages": [4, 5, 6, 7]}), ("set_v1", {"pages": [0, 1, 2, 3]})]:
        answer = d.ok(op, keys=keys, **args)
        assert answer["ok"] == [False] * 4 and answer["s"] < 0.5, answer
        assert answer["logs"] == [], answer["logs"]
    assert d.ok("exists", keys=keys)["count"] == 0


def test_a_store_node_killed_under_the_backend_fails_its_pages(driver, cluster):
    c, d = cluster(), driver()
    backend(d, c.master, timeout_s=2, retry_s=1)
    keys = pages(3, "node")
    d.ok("fill", pages=[0, 1, 2])
    assert d.ok("set_v1", keys=keys, pages=[0, 1, 2])["ok"] == [True] * 3
    c.nodes[0].kill()
    got = d.ok("get_v1", keys=keys, pages=[4, 5, 6])
    assert got["ok"] == [False] * 3 and got["s"] < 30, got
    put = d.ok("set_v1", keys=pages(2, "after"), pages=[0, 1])
    assert put["ok"] == [False, False] and put["s"] < 30, put


def test_a_full_cluster_fails_or_evicts_but_what_exists_reads_back_whole(driver, cluster):
    """8 MiB of store for 24 MiB of pages: sets go on (the master evicts prefix tails) or are
    reported failed; every page ``batch_exists`` reports reads back byte for byte."""
    c, d = cluster(segment_size="8MiB"), driver()
    d.ok("pool", layout="page_first", pages=64, layers=8, heads=4, head_dim=64)  # 256 KiB pages
    assert d.ok("backend", extra={**BACKEND, "master": c.master, "interface_v1": 1})
    results = []
    for batch in range(3):
        keys = pages(32, f"full{batch}")
        d.ok("fill", pages=list(range(32)), seed=batch)
        answer = d.ok("set_v1", keys=keys, pages=list(range(32)),
                      prefix=None if batch == 0 else pages(32, f"full{batch - 1}"))
        assert answer["s"] < 60, answer
        results.append(answer["ok"])
        want = d.ok("digest", pages=list(range(32)))["digests"]
        n = d.ok("exists", keys=keys)["count"]
        if n:
            assert d.ok("get_v1", keys=keys[:n], pages=list(range(32, 32 + n)))["ok"] == [True] * n
            assert d.ok("digest", pages=list(range(32, 32 + n)))["digests"] == want[:n]
    assert sum(map(sum, results)) >= 32, results   # the store took what fits
