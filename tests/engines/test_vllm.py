"""KVPoolConnector with a real vLLM on CPU and a real kvpool cluster.

Every engine is its own process (tests/engines/vllm_driver.py under the venv of
scripts/engines/vllm-env.sh), running a tiny random Llama greedily: KV one process computed is
loaded by another, and the tokens that follow are exactly a cold run's. ``cold`` is a run
without any connector (and without vLLM's own prefix cache), once per session.
"""

from __future__ import annotations

import os
import random
import socket
import time

import numpy as np
import pytest
from kvpool.client import KVClient
from kvpool.client.router import Candidate, RouterClient
from kvpool.client.transport.base import IoOp
from kvpool.client.transport.shm import SHMTransport
from kvpool.client.vllm_events import ZMQEventBridge
from kvpool.common.errors import NoSpace, ObjectNotFound
from kvpool.common.hashing import HashSpec
from kvpool.rpc.master_client import MasterClient

BLOCK = 32
# The first build of the venv (~3 min on 2 cores) lands in whichever test runs first.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


PROMPT_A = _tokens(14 * BLOCK + 10, 1)                 # 14 full blocks and a partial one
PROMPT_B = PROMPT_A[:12 * BLOCK] + _tokens(40, 2)      # A's first 12 blocks, then its own


def log_fields(lines: list[str], event: str) -> list[dict[str, str]]:
    """The key=value fields of each log line carrying ``event``."""
    return [dict(kv.split("=", 1) for kv in line.split(event, 1)[1].split() if "=" in kv)
            for line in lines if f"{event} " in line]


def loaded_blocks(answer: dict) -> tuple[int, int]:
    """(blocks loaded, blocks that failed to load) for one request."""
    rows = log_fields(answer["logs"], "kvpool_kv_loaded")
    return (sum(int(r["blocks"]) for r in rows), sum(int(r["failed_blocks"]) for r in rows))


def wait_stored(master: str, keys: list[str], timeout_s: float = 20.0) -> None:
    """Saves run in the background: wait until every key is in the pool."""
    with KVClient(master) as kv:
        deadline = time.monotonic() + timeout_s
        while not all(kv.batch_exists(keys)):
            assert time.monotonic() < deadline, "the engine's blocks never reached the pool"
            time.sleep(0.1)


def alter(master: str, keys: list[str]) -> None:
    """Change stored KV behind kvpool's back: each object's floats negated in place in its
    node's segment (valid numbers, so only the values differ; the checksum stays the old one)."""
    with MasterClient(master) as mc, KVClient(master, transports=["tcp"]) as kv:
        views = mc.locate(keys).views()
        tcp = SHMTransport()   # a trusted writer's mapping: tcp writes only granted extents
        try:
            for key, view in zip(keys, views):
                data = np.frombuffer(kv.get(key), dtype=np.float32)
                bad = memoryview((-data).astype(np.float32).tobytes())
                errors = tcp.write([IoOp(r, bad) for r in view.replicas])
                assert errors == [None] * len(view.replicas), errors
        finally:
            tcp.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_prefix_kv_is_shared_across_engine_processes(engine, kv_cluster, cold):
    c = kv_cluster()
    # A, cold: nothing to load; every full block is stored. Its KV events reach the router
    # through the bridge (`kvpool kv-events`), so Route sees the blocks in the engine's cache.
    port = free_port()
    a = engine(master=c.master, kv_events=f"tcp://*:{port}")
    bridge = ZMQEventBridge(f"tcp://127.0.0.1:{port}", "engine-a", c.master,
                            HashSpec.of(BLOCK, model="tiny")).start()
    try:
        time.sleep(1.0)   # ZMQ drops what a PUB socket sends before the subscription lands
        first = a.generate(PROMPT_A)
        keys_a = a.keys(PROMPT_A)
        with RouterClient(c.master) as router:
            deadline = time.monotonic() + 20
            while (hits := router.route(token_ids=PROMPT_A, extra_keys={"model": "tiny"},
                                        candidates=[Candidate("engine-a")],
                                        policy="prefix_affinity").hits)["gpu"] < 14:
                assert time.monotonic() < deadline, hits
                time.sleep(0.1)
            assert hits == {"gpu": 14, "cpu": 0, "store": 0}
    finally:
        bridge.stop()
    a.close()
    assert first["tokens"] == cold(PROMPT_A)["tokens"]
    assert first["cached_tokens"] == 0 and loaded_blocks(first) == (0, 0)
    assert len(keys_a) == 14   # key scheme vllm2: one object per block
    wait_stored(c.master, keys_a)

    # B shares A's first 12 blocks: another process loads them, and computes the same tokens
    # as a cold run of B.
    b = engine(master=c.master)
    hit = b.generate(PROMPT_B)
    b.close()
    assert hit["cached_tokens"] == 12 * BLOCK
    assert loaded_blocks(hit) == (12, 0)
    assert hit["tokens"] == cold(PROMPT_B)["tokens"]

    # A again, in a third process: every full block (the last token is always computed).
    a2 = engine(master=c.master)
    again = a2.generate(PROMPT_A)
    # The connector counts in the engine's registry (what vLLM's /metrics serves).
    assert a2.metrics("kvpool_client_keys_total", op="get", result="hit") == 14
    assert a2.metrics("kvpool_client_bytes_total", op="get", transport="shm") \
        == 14 * 2 * 2 * 32 * 128 * 4
    a2.close()
    assert again["cached_tokens"] == 14 * BLOCK
    assert loaded_blocks(again) == (14, 0)
    assert again["tokens"] == cold(PROMPT_A)["tokens"]
    assert sum(int(r["bytes"]) for r in log_fields(again["logs"], "kvpool_kv_loaded")) \
        == 14 * 2 * 2 * 32 * 128 * 4   # blocks, layers, KV heads, tokens, K+V dims, float32


def test_loaded_kv_is_really_used_and_verified(engine, kv_cluster, cold):
    c = kv_cluster()
    # vLLM's own prefix cache off, so the second request of this process loads from kvpool.
    e = engine(master=c.master, verify=False, prefix_caching=False)
    assert e.generate(PROMPT_A)["tokens"] == cold(PROMPT_A)["tokens"]
    keys = e.keys(PROMPT_A)
    wait_stored(c.master, keys)
    alter(c.master, keys)
    wrong = e.generate(PROMPT_A)
    e.close()
    assert loaded_blocks(wrong) == (14, 0)
    assert wrong["tokens"] != cold(PROMPT_A)["tokens"], "altered KV loaded, yet no change"

    # Integrity checks on: the alteration is caught, the blocks count as missing, vLLM
    # recomputes them, and the tokens are the cold ones.
    v = engine(master=c.master, verify=True)
    checked = v.generate(PROMPT_A)
    v.close()
    assert loaded_blocks(checked) == (0, 14)
    reasons = {r["reasons"] for r in log_fields(checked["logs"], "kvpool_load_failed")}
    assert reasons == {"CorruptObject"}
    assert checked["tokens"] == cold(PROMPT_A)["tokens"]


def test_engine_runs_when_the_master_is_down(engine, cold):
    e = engine(master=f"127.0.0.1:{free_port()}")   # nobody listens there
    out = e.generate(PROMPT_A)
    more = e.generate(PROMPT_B)
    bye = e.close()
    assert out["tokens"] == cold(PROMPT_A)["tokens"]
    assert more["tokens"] == cold(PROMPT_B)["tokens"]
    assert log_fields(out["logs"] + more["logs"] + bye["logs"], "kvpool_unavailable")


def test_store_node_killed_between_save_and_load(engine, kv_cluster, cold):
    # A long node TTL: the master still lists the dead node's objects when the engine asks,
    # so the load itself must fail (over tcp: an shm mapping would outlive the node).
    c = kv_cluster(nodes=1, master_args=["--node-ttl", "60s"])
    e = engine(master=c.master, prefix_caching=False, transports="tcp")
    assert e.generate(PROMPT_A)["tokens"] == cold(PROMPT_A)["tokens"]
    wait_stored(c.master, e.keys(PROMPT_A))
    c.nodes[0].kill()
    out = e.generate(PROMPT_A)
    after = e.generate(PROMPT_B)
    e.close()
    assert loaded_blocks(out) == (0, 14)
    assert out["tokens"] == cold(PROMPT_A)["tokens"]
    assert after["tokens"] == cold(PROMPT_B)["tokens"]


def test_engine_runs_when_the_store_is_full(engine, kv_cluster, cold):
    # Every byte hard-pinned (pins may take it all): no put finds room, none can evict.
    c = kv_cluster(master_args=["--pin-quota", "1"], segment_size="4MiB")
    # No slots: a slot asked for may evict the last filler before its pin (client/slots.py).
    with KVClient(c.master, put_slots=False) as kv:
        size = 256 << 10   # then smaller, for the gaps large extents leave (master/allocator.py)
        for i in range(1000):
            try:
                kv.put(f"filler/{i}", bytes(size), pin=True)
            except (NoSpace, ObjectNotFound):   # not found: evicted before its pin (the
                size //= 2                      # one object the watermark could take)
                if size < 64:
                    break
        else:
            raise AssertionError("the cluster never filled up")
    e = engine(master=c.master, prefix_caching=False)
    out = e.generate(PROMPT_A)
    again = e.generate(PROMPT_A)
    bye = e.close()
    assert out["tokens"] == again["tokens"] == cold(PROMPT_A)["tokens"]
    assert loaded_blocks(again) == (0, 0)
    reasons = {r["reasons"] for r in log_fields(out["logs"] + again["logs"] + bye["logs"],
                                                "kvpool_save_failed")}
    assert reasons == {"NoSpace"}


def test_the_per_layer_scheme_is_never_matched_by_the_per_block_one(engine, kv_cluster, cold):
    c = kv_cluster()
    old = engine(master=c.master, extra=("--key-scheme", "vllm1"))
    assert old.generate(PROMPT_A)["tokens"] == cold(PROMPT_A)["tokens"]
    keys = old.keys(PROMPT_A)
    assert len(keys) == 14 * 2 and all(k.startswith("kvpool/vllm1/") for k in keys)
    old.close()
    wait_stored(c.master, keys)
    new = engine(master=c.master)
    out = new.generate(PROMPT_A)
    new.close()
    assert out["cached_tokens"] == 0 and loaded_blocks(out) == (0, 0)
    assert out["tokens"] == cold(PROMPT_A)["tokens"]

# A CUDA build of vLLM (vllm-env.sh builds the CPU one): the Python of an environment with it
# and this checkout's kvpool, e.g. `pip install vllm==0.32.0 -e .` in a venv on a GPU host.
CUDA_PYTHON = os.environ.get("KVPOOL_VLLM_CUDA_PYTHON", "")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA_PYTHON, reason="gpu: set KVPOOL_VLLM_CUDA_PYTHON to the Python of "
                    "a CUDA build of vLLM 0.32 with this kvpool (none here: no CUDA device)")
def test_gpu_engines_share_a_prefix_token_identical(engine, kv_cluster):
    """Two vLLM engine processes on the GPU: the second loads the first's prefix from kvpool
    (layer by layer, through pinned staging on the connector's stream) and answers the same
    tokens as a cold GPU engine."""
    c = kv_cluster()
    cold = engine(python=CUDA_PYTHON, prefix_caching=False)
    want_a, want_b = cold.generate(PROMPT_A)["tokens"], cold.generate(PROMPT_B)["tokens"]
    cold.close()
    a = engine(python=CUDA_PYTHON, master=c.master)
    assert a.generate(PROMPT_A)["tokens"] == want_a
    keys = a.keys(PROMPT_A)
    a.close()
    wait_stored(c.master, keys)
    b = engine(python=CUDA_PYTHON, master=c.master)
    hit = b.generate(PROMPT_B)
    b.close()
    assert loaded_blocks(hit) == (12, 0)
    assert hit["tokens"] == want_b
