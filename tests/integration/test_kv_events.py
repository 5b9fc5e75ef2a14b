"""KV events from a real ZMQ publisher (vLLM's wire format) in a subprocess, into the master."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from kvpool.client.router import Candidate, RouterClient
from kvpool.client.vllm_events import ZMQEventBridge
from kvpool.common.hashing import HashSpec

PUBLISHER = Path(__file__).parent / "vllm_publisher.py"


def wait_for(fn, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while True:
        value = fn()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.05)


def test_vllm_events_from_a_zmq_publisher_reach_the_router(cluster):
    spec = HashSpec.of(16, model="m")
    pub = subprocess.Popen([sys.executable, str(PUBLISHER)], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, text=True)
    try:
        endpoint = pub.stdout.readline().split(": ", 1)[1].strip()
        bridge = ZMQEventBridge(endpoint, "vllm-0", cluster.master, spec).start()
        try:
            assert pub.stdout.readline().strip() == "published: 3"
            with RouterClient(cluster.master) as router:
                def hits():
                    got = router.route(token_ids=list(range(64)), extra_keys={"model": "m"},
                                       candidates=[Candidate("vllm-0")], policy="prefix_affinity")
                    return got.hits if got.hits["cpu"] else None
                # Blocks 0-2 on the engine's GPU, block 3 offloaded to its CPU: re-hashed
                # with kvpool's spec from the token ids, so a plain token-id Route matches.
                assert wait_for(hits) == {"gpu": 3, "cpu": 1, "store": 0}
                removed = router.route(token_ids=[9] * 16, extra_keys={"model": "m"},
                                       candidates=[Candidate("vllm-0")])
                assert removed.hits["gpu"] == 0
        finally:
            applied = bridge.stop()
        assert applied == 4 and bridge.batches == 3 and bridge.missed_batches == 0
    finally:
        pub.stdin.close()
        pub.wait(timeout=10)


def test_kv_events_command_teaches_its_flags():
    r = subprocess.run([sys.executable, "-m", "kvpool", "kv-events", "--help"],
                       capture_output=True, text=True, check=False, timeout=60)
    assert r.returncode == 0 and "--endpoint" in r.stdout and "--block-size" in r.stdout
    r = subprocess.run([sys.executable, "-m", "kvpool", "kv-events", "--master", "127.0.0.1:1"],
                       capture_output=True, text=True, check=False, timeout=60)
    assert r.returncode == 2 and "--endpoint" in r.stderr and "Traceback" not in r.stderr
