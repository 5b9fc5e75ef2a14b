"""A vLLM OpenAI server with the kvpool connector and its KV events, started the one way the
engine tests (tests/engines/test_gateway*.py) and the live replay bench
(scripts/engines/bench_replay_gateway.py) both start it.

vLLM itself runs under the Python of scripts/engines/vllm-env.sh (``python``); nothing here
imports it. Each server gets a process group of its own (``start_new_session``), so that
stopping it stops its children (vLLM's engine core) and nothing else.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import signal
import socket
import subprocess
import time
from pathlib import Path

BLOCK_TOKENS = 32


def free_port() -> int:
    """A port free now, for a server that binds it later (vLLM binds its ports a minute into
    its start): one below the kernel's ephemeral range, which no outgoing connection is given
    meanwhile. A port from ``bind(0)`` is an ephemeral one, and was taken so: an engine failed
    "Address already in use" on its KV-events port (CI, session 14)."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0
    rng = random.Random()
    for _ in range(200 if low > 12000 else 0):
        port = rng.randrange(10000, low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_argv(python: str, model: str, *, master: str, port: int, events_port: int,
                served_model_name: str, max_model_len: int, kv_role: str = "kv_both",
                block_tokens: int = BLOCK_TOKENS, **extra_config) -> list[str]:
    """The command line: float32, eager, seed 0 (answers comparable between runs), the
    connector in ``kv_role`` on ``master`` (``extra_config``: its other options, e.g.
    ``timeout_s``, ``load_wait_s``) and KV events published on ``events_port``."""
    kv_transfer = {"kv_connector": "KVPoolConnector",
                   "kv_connector_module_path": "kvpool.client.connectors.vllm",
                   "kv_role": kv_role, "kv_load_failure_policy": "recompute",
                   "kv_connector_extra_config": {"master": master, **extra_config}}
    kv_events = {"enable_kv_cache_events": True, "publisher": "zmq",
                 "endpoint": f"tcp://*:{events_port}"}
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
            "--served-model-name", served_model_name, "--host", "127.0.0.1",
            "--port", str(port), "--dtype", "float32", "--max-model-len", str(max_model_len),
            "--enforce-eager", "--block-size", str(block_tokens), "--seed", "0",
            "--kv-transfer-config", json.dumps(kv_transfer),
            "--kv-events-config", json.dumps(kv_events)]


def start_server(python: str, model: str, log: Path, *, cpus: str | None = None,
                 **kw) -> tuple[subprocess.Popen, str]:
    """Start a server (:func:`server_argv`'s keywords, less ``port``: a free one), its output
    to ``log``; returns the process and its URL. Not yet serving: :func:`wait_healthy`.
    ``cpus`` (e.g. ``"0"``): the cores it runs on, its OpenMP threads bound there too
    (``VLLM_CPU_OMP_THREADS_BIND``); by default vLLM binds them to every core."""
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    argv = server_argv(python, model, port=port, **kw)
    if cpus is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpus
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
        argv = ["taskset", "-c", cpus, *argv]
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, stdout=out,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return proc, f"http://127.0.0.1:{port}"


def wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout_s: float) -> None:
    """Until ``GET /health`` answers 200; RuntimeError with the log's tail if the server exits
    or takes longer than ``timeout_s``."""
    host, port = url.split("//")[1].rsplit(":", 1)
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the engine at {url} exited ({proc.returncode}):\n"
                               + log.read_text()[-4000:])
        conn = http.client.HTTPConnection(host, int(port), timeout=5)
        try:
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        finally:
            conn.close()
        if time.monotonic() > deadline:
            raise RuntimeError(f"the engine at {url} not healthy in {timeout_s:.0f} s")
        time.sleep(1)


def stop_groups(procs: list[subprocess.Popen], timeout_s: float = 20) -> None:
    """Interrupt each process's group (started with ``start_new_session``), then kill what is
    left after ``timeout_s``."""
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGINT)
    for p in procs:
        try:
            p.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
