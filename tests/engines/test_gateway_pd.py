"""Disaggregated prefill and decode through kvpool, all real processes: ``kvpool gateway
--prefill P --decode D`` in front of two vLLM CPU engines with the kvpool connector, P a
``kv_producer`` (its KV events bridged to the master, so Route sees its prefixes), D a
``kv_consumer``, and a kvpool cluster between them.

The colocated run each answer is compared with is the whole request sent to P directly: P
computes every token itself (a producer never loads), as a colocated engine does.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from kvpool.tools.cluster import LocalCluster
from kvpool.tools.vllm_server import stop_groups

from .test_gateway import (
    BLOCK,
    MODEL,
    Server,
    completion,
    free_port,
    read_stream,
    start_engine,
    start_line,
    wait_healthy,
    words,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]
LOAD_WAIT_S = 3.0


@dataclass
class PD:
    cluster: LocalCluster
    tiny_model: str
    prefill: Server
    decode: Server
    gateway: Server
    tmp: Path


@pytest.fixture(scope="module")
def pd(vllm_python, tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gateway-pd")
    cluster = LocalCluster(nodes=1, segment_size="64MiB", log_dir=tmp / "cluster")
    cluster.start()
    procs: list[subprocess.Popen] = []
    engines: list[Server] = []
    try:
        events = free_port()
        engines.append(start_engine(vllm_python, tiny_model, cluster.master, "prefill", events,
                                    tmp / "engine-prefill.log", kv_role="kv_producer"))
        d_events = free_port()
        engines.append(start_engine(vllm_python, tiny_model, cluster.master, "decode",
                                    d_events, tmp / "engine-decode.log",
                                    kv_role="kv_consumer", load_wait_s=LOAD_WAIT_S))
        for e in engines:
            wait_healthy(e)
        # Each engine connects to kvpool as it starts, not on its first request (that cost
        # a producer's first save seconds under load, past the consumer's wait for it).
        # The producer's worker; the consumer's worker and scheduler (which looks blocks up).
        for e, count in zip(engines, (1, 2)):
            wait_logged(e, "kvpool_store_connected", count)
        # Both bridged, announcing their servers and roles (for the --discover test); Route
        # sees P's prefixes.
        for name, port, engine, role in (("p", events, engines[0], "prefill"),
                                          ("d", d_events, engines[1], "decode")):
            procs.append(start_line(
                ["kv-events", "--master", cluster.master, "--endpoint",
                 f"tcp://127.0.0.1:{port}", "--instance-id", name, "--block-size", str(BLOCK),
                 "--model", MODEL, "--url", engine.url, "--role", role],
                tmp / f"kv-events-{name}.log", "kv-events:"))
        gw = start_line(["gateway", "--master", cluster.master, "--model", tiny_model,
                         "--served-model-name", MODEL, "--prefill", f"p={engines[0].url}",
                         "--decode", f"d={engines[1].url}", "--port", "0"],
                        tmp / "gateway.log", "gateway: http://")
        procs.append(gw)
        yield PD(cluster, tiny_model, *engines, Server("gateway", gw.first_line.split()[1], gw,
                                           tmp / "gateway.log"), tmp)
    finally:
        stop_groups(procs)
        for e in engines:
            e.kill()
        cluster.stop()
    log = (tmp / "gateway.log").read_text()
    assert "Traceback" not in log, log[-3000:]


class LogWatch:
    """The key=value fields of an engine's log lines carrying an event, since a mark."""

    def __init__(self, server: Server):
        self.server = server
        self.mark()

    def mark(self) -> None:
        self._offset = len(self.server.log.read_bytes())

    def events(self, event: str) -> list[dict[str, str]]:
        text = self.server.log.read_bytes()[self._offset:].decode(errors="replace")
        return [dict(kv.split("=", 1) for kv in line.split(event, 1)[1].split() if "=" in kv)
                for line in text.splitlines() if f"{event} " in line]


def wait_logged(server: Server, event: str, count: int, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while (n := server.log.read_text(errors="replace").count(f"{event} ")) < count:
        assert time.monotonic() < deadline, f"{server.name} logged {event} {n} times"
        time.sleep(0.2)


def loadable(prompt_tokens: int) -> int:
    """The blocks a decode engine loads: every full block but the one with the last token."""
    return (prompt_tokens - 1) // BLOCK


def test_answers_are_a_colocated_runs_and_the_decode_engine_loaded_the_prompt(pd):
    d_log, p_log = LogWatch(pd.decode), LogWatch(pd.prefill)
    chat = {"model": MODEL, "temperature": 0, "max_tokens": 12, "ignore_eos": True,
            "messages": [{"role": "system", "content": words(40, 41)},
                         {"role": "user", "content": words(60, 42)}]}
    for path, body, text in [
        ("/v1/completions", completion(words(120, 40), 16), lambda a: a["choices"][0]["text"]),
        ("/v1/chat/completions", chat, lambda a: a["choices"][0]["message"]["content"]),
    ]:
        d_log.mark()
        status, headers, via = pd.gateway.post(path, body)
        assert status == 200, via
        assert headers["x-kvpool-engine"] == "d" and headers["x-kvpool-prefill-engine"] == "p"
        status, _, colocated = pd.prefill.post(path, body)
        assert status == 200
        assert text(via) == text(colocated) and text(via)
        assert via["usage"] == colocated["usage"]
        # The decode engine computed only the last prompt token: the rest came from kvpool.
        loads = d_log.events("kvpool_kv_loaded")
        want = loadable(via["usage"]["prompt_tokens"])
        assert want >= 3 and sum(int(r["blocks"]) for r in loads) == want, loads
        assert all(r["failed_blocks"] == "0" for r in loads)
    # Roles: the producer never loads, the consumer never stores.
    assert p_log.events("kvpool_kv_loaded") == [] and p_log.events("kvpool_prefix_hit") == []
    assert "kvpool_kv_saved" not in pd.decode.log.read_text()


def test_a_disaggregated_stream_arrives_in_pieces_and_matches_a_colocated_one(pd):
    body = completion(words(80, 50), max_tokens=60, stream=True)
    # vLLM merges the deltas of a stream whose reader falls behind: on a loaded 2-core host
    # one answer in a few came as 3 chunks within 2 ms (CI). One answer in pieces, out of
    # three, shows the gateway passes the stream on as it comes.
    for _ in range(3):
        chunks, headers = read_stream(pd.gateway, body)
        assert headers["x-kvpool-engine"] == "d"
        events = [e for e in b"".join(c for _, c in chunks).split(b"\n\n")
                  if e.startswith(b"data: ")]
        assert events[-1] == b"data: [DONE]" and len(events) >= 10
        if len(chunks) >= 5 and chunks[-1][0] - chunks[0][0] > 0.05:
            break
    assert len(chunks) >= 5 and chunks[-1][0] - chunks[0][0] > 0.05, [t for t, _ in chunks]
    text = "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-1])
    _, _, colocated = pd.prefill.post("/v1/completions", {**body, "stream": False})
    assert text == colocated["choices"][0]["text"]


def test_a_consumer_whose_kv_never_comes_recomputes_after_its_bounded_wait(pd):
    d_log = LogWatch(pd.decode)
    # As the gateway sends it after a prefill, but no prefill ran: the blocks never come.
    body = completion(words(120, 60), 8, kv_transfer_params={"kvpool_blocks": 2})
    t0 = time.monotonic()
    status, _, answer = pd.decode.post("/v1/completions", body)
    waited = time.monotonic() - t0
    assert status == 200, answer
    assert LOAD_WAIT_S <= waited < LOAD_WAIT_S + 60
    [expired] = d_log.events("kvpool_load_wait_expired")
    assert expired["expected_blocks"] == "2" and expired["found_blocks"] == "0"
    assert d_log.events("kvpool_kv_loaded") == []
    del body["kv_transfer_params"]
    _, _, colocated = pd.prefill.post("/v1/completions", body)
    assert answer["choices"][0]["text"] == colocated["choices"][0]["text"]
    # Without the prefill's word, a consumer does not wait.
    d_log.mark()
    status, _, _ = pd.decode.post("/v1/completions", completion(words(120, 61), 4))
    assert status == 200 and d_log.events("kvpool_load_wait_expired") == []


def test_a_request_the_prefill_engine_refuses_gets_its_error(pd):
    # Longer than the engines' max_model_len (512): the prefill engine answers 400.
    status, headers, answer = pd.gateway.post("/v1/completions", completion(words(900, 70), 4))
    assert status == 400 and set(answer["error"]) >= {"message", "type"}, answer
    assert headers["x-kvpool-prefill-engine"] == "p"


def test_a_gateway_discovers_the_pair_through_the_master(pd):
    gw = start_line(["gateway", "--master", pd.cluster.master, "--discover", "--model",
                     pd.tiny_model, "--served-model-name", MODEL, "--port", "0"],
                    pd.tmp / "gateway-discover.log", "gateway: http://")
    server = Server("gateway-discover", gw.first_line.split()[1], gw,
                    pd.tmp / "gateway-discover.log")
    try:
        deadline = time.monotonic() + 30
        while True:     # found at start; up once a probe found each healthy
            status, _, health = server.request("GET", "/health")
            if json.loads(health) == {"engines": {"p": True, "d": True}}:
                break
            assert time.monotonic() < deadline, health
            time.sleep(0.2)
        body = completion(words(100, 80), 8)
        status, headers, via = server.post("/v1/completions", body)
        assert status == 200, via
        assert headers["x-kvpool-engine"] == "d" and headers["x-kvpool-prefill-engine"] == "p"
        _, _, colocated = pd.prefill.post("/v1/completions", body)
        assert via["choices"][0]["text"] == colocated["choices"][0]["text"]
    finally:
        gw.send_signal(signal.SIGINT)
        gw.wait(timeout=20)
    log = server.log.read_text()
    assert "engine_discovered" in log and "Traceback" not in log, log[-3000:]
