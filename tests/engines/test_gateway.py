"""``kvpool gateway`` in front of two real vLLM CPU engines (OpenAI servers with the kvpool
connector, their KV events bridged to the master by ``kvpool kv-events``), all real processes.

One set-up for the module (starting two engines costs a minute on 2 cores); the test that kills
an engine runs last.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from kvpool.client.router import Candidate, RouterClient
from kvpool.tools import vllm_server
from kvpool.tools.cluster import LocalCluster
from kvpool.tools.vllm_server import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]
MODEL = "tiny"
BLOCK = 32
START_TIMEOUT_S = 300
TRACE = Path(__file__).parents[1] / "data" / "mooncake_conversation_trace_head.jsonl"


def words(n: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(f"w{rng.randrange(7, 1000)}" for _ in range(n))


@dataclass
class Server:
    """An HTTP server process of ours (an engine or the gateway), in a process group of its own
    so that killing it kills its children (vLLM's engine core) and nothing else."""

    name: str
    url: str
    proc: subprocess.Popen
    log: Path

    def request(self, method: str, path: str, body=None, timeout: float = 120
                ) -> tuple[int, dict, bytes]:
        host, port = self.url.split("//")[1].rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
        try:
            conn.request(method, path, None if body is None else json.dumps(body),
                         {"Content-Type": "application/json"})
            r = conn.getresponse()
            return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
        finally:
            conn.close()

    def post(self, path: str, body: dict) -> tuple[int, dict, dict]:
        status, headers, data = self.request("POST", path, body)
        return status, headers, json.loads(data)

    def metric(self, name: str, **labels: str) -> float:
        """The sum of the samples of ``name`` whose labels include ``labels``."""
        _, _, page = self.request("GET", "/metrics")
        total = 0.0
        for line in page.decode().splitlines():
            if line.startswith((name + "{", name + " ")) and all(f'{k}="{v}"' in line
                                                   for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def start_engine(python: str, model: str, master: str, name: str, events_port: int,
                 log: Path, kv_role: str = "kv_both", **extra_config) -> Server:
    proc, url = vllm_server.start_server(
        python, model, log, master=master, events_port=events_port, served_model_name=MODEL,
        max_model_len=512, kv_role=kv_role, block_tokens=BLOCK,
        **{"timeout_s": 2.0, **extra_config})
    return Server(name, url, proc, log)


def wait_healthy(server: Server, timeout_s: float = START_TIMEOUT_S) -> None:
    vllm_server.wait_healthy(server.url, server.proc, server.log, timeout_s)


def start_line(argv: list[str], log: Path, prefix: str) -> subprocess.Popen:
    """A kvpool command that prints ``prefix...`` once it serves."""
    err = open(log, "w")   # noqa: SIM115  (the child holds it; closed with the test's tmp)
    proc = subprocess.Popen([sys.executable, "-m", "kvpool", *argv], stdout=subprocess.PIPE,
                            stderr=err, text=True, start_new_session=True)
    line = proc.stdout.readline()
    assert line.startswith(prefix), line + log.read_text()
    proc.first_line = line
    return proc


@dataclass
class Setup:
    cluster: LocalCluster
    engines: dict[str, Server]
    gateway: Server


@pytest.fixture(scope="module")
def setup(vllm_python, tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gateway")
    cluster = LocalCluster(nodes=1, segment_size="64MiB", log_dir=tmp / "cluster")
    cluster.start()
    procs: list[subprocess.Popen] = []
    engines: dict[str, Server] = {}
    try:
        events = {name: free_port() for name in ("a", "b")}
        for name in ("a", "b"):     # both load at once
            engines[name] = start_engine(vllm_python, tiny_model, cluster.master, name,
                                         events[name], tmp / f"engine-{name}.log")
        for e in engines.values():
            wait_healthy(e)
        for name in ("a", "b"):     # the instance ids Route answers are the gateway's ids
            procs.append(start_line(
                ["kv-events", "--master", cluster.master, "--endpoint",
                 f"tcp://127.0.0.1:{events[name]}", "--instance-id", name, "--block-size",
                 str(BLOCK), "--model", MODEL], tmp / f"kv-events-{name}.log", "kv-events:"))
        gw = start_line(["gateway", "--master", cluster.master, "--model", tiny_model,
                         "--served-model-name", MODEL, "--engines",
                         ",".join(f"{n}={e.url}" for n, e in engines.items()),
                         "--port", "0"], tmp / "gateway.log", "gateway: http://")
        procs.append(gw)
        time.sleep(1.0)   # ZMQ drops what a PUB socket sends before the subscription lands
        yield Setup(cluster, engines, Server("gateway", gw.first_line.split()[1], gw,
                                             tmp / "gateway.log"))
    finally:
        vllm_server.stop_groups(procs)
        for e in engines.values():
            e.kill()
        cluster.stop()
    log = (tmp / "gateway.log").read_text()
    assert "Traceback" not in log, log[-3000:]


def completion(prompt, max_tokens: int = 8, **kw) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, **kw}


def test_answers_are_the_engines_own(setup):
    gw = setup.gateway
    for path, body, text in [
        ("/v1/completions", completion(words(40, 1)), lambda a: a["choices"][0]["text"]),
        ("/v1/chat/completions",
         {"model": MODEL, "temperature": 0, "max_tokens": 8, "ignore_eos": True,
          "messages": [{"role": "system", "content": words(10, 2)},
                       {"role": "user", "content": words(30, 3)}]},
         lambda a: a["choices"][0]["message"]["content"]),
    ]:
        status, headers, via = gw.post(path, body)
        assert status == 200, via
        engine = setup.engines[headers["x-kvpool-engine"]]
        status, _, direct = engine.post(path, body)
        assert status == 200
        assert text(via) == text(direct) and text(via)
        # The gateway's tokens are the engine's: the same prompt length.
        assert via["usage"]["prompt_tokens"] == direct["usage"]["prompt_tokens"]


def read_stream(server: Server, body: dict) -> tuple[list[tuple[float, bytes]], dict]:
    """The body's chunks as they arrived (time since the request, bytes) and the headers."""
    host, port = server.url.split("//")[1].rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    try:
        t0 = time.perf_counter()
        conn.request("POST", "/v1/completions", json.dumps(body),
                     {"Content-Type": "application/json"})
        r = conn.getresponse()
        assert r.status == 200, r.read()
        chunks = []
        while chunk := r.read1(65536):
            chunks.append((time.perf_counter() - t0, chunk))
        return chunks, {k.lower(): v for k, v in r.getheaders()}
    finally:
        conn.close()


def test_a_stream_arrives_in_pieces_as_the_engine_makes_them(setup):
    # 400 tokens take seconds to make here. With 120 (about 0.5 s), CI once saw all three
    # tries arrive whole: the engines' own threads held both cores for a whole generation,
    # and the gateway and this reader ran only at its end. Under two extra busy loops, 400
    # tokens came through the gateway in 9 pieces or more over 0.9 s or more (6 of 6 tries).
    body = completion(words(20, 4), max_tokens=400, stream=True)
    # Not all at the end: the first token came well before the last. A gateway that holds
    # the stream back does so every time; a starved reader only now and then.
    for _ in range(3):
        chunks, _ = read_stream(setup.gateway, body)
        if chunks[-1][0] - chunks[0][0] > 0.1:
            break
    assert chunks[-1][0] - chunks[0][0] > 0.1, [t for t, _ in chunks]
    body_bytes = b"".join(c for _, c in chunks)
    events = [e for e in body_bytes.split(b"\n\n") if e.startswith(b"data: ")]
    # A token an event, and the end (vLLM merges tokens its server had no time to send yet).
    assert events[-1] == b"data: [DONE]" and 10 <= len(events) <= 401
    assert len(chunks) >= 5
    text = "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-1])
    _, _, whole = setup.gateway.post("/v1/completions", completion(words(20, 4), 400))
    assert text == whole["choices"][0]["text"]


def test_a_repeated_long_prefix_goes_to_the_engine_that_holds_it(setup):
    # The prefix is computed on b, called directly: b holds it in its own cache. a comes first
    # in the gateway's list, so load alone (or a tie) would choose a.
    prefix = words(12 * BLOCK, 5)
    b = setup.engines["b"]
    status, _, _ = b.post("/v1/completions", completion(prefix + " " + words(5, 6), 1))
    assert status == 200
    with RouterClient(setup.cluster.master) as router:   # b's KV events reached the master
        deadline = time.monotonic() + 30
        while router.route(token_ids=[int(w[1:]) for w in prefix.split()],
                           candidates=[Candidate("a"), Candidate("b")],
                           extra_keys={"model": MODEL}).hits["gpu"] < 12:
            assert time.monotonic() < deadline, "b's KV events never reached the master"
            time.sleep(0.2)
    hits_before = b.metric("vllm:prefix_cache_hits_total")
    chosen = []
    for i in range(4):
        status, headers, _ = setup.gateway.post(
            "/v1/completions", completion(prefix + " " + words(5, 10 + i), 2))
        assert status == 200
        chosen.append(headers["x-kvpool-engine"])
    assert chosen == ["b"] * 4
    assert b.metric("vllm:prefix_cache_hits_total") - hits_before >= 4 * 12 * BLOCK
    assert setup.gateway.metric("kvpool_gateway_expected_hit_blocks_total",
                                engine="b", tier="gpu") >= 4 * 12


def test_bad_requests_get_openai_error_bodies(setup):
    gw = setup.gateway
    status, _, answer = gw.post("/v1/completions", completion("w5 w6", max_tokens=-5))
    assert status == 400       # the engine's answer, passed through
    assert set(answer["error"]) == {"message", "type", "param", "code"}
    assert "max_tokens" in answer["error"]["message"]
    status, _, answer = gw.post("/v1/completions", {**completion("w5"), "model": "gpt-x"})
    assert status == 404 and answer["error"]["code"] == "model_not_found"


def test_a_client_that_goes_away_cancels_its_engine_request(setup):
    gw = setup.gateway
    generated = {n: e.metric("vllm:generation_tokens_total")
                 for n, e in setup.engines.items()}
    host, port = gw.url.split("//")[1].rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", "/v1/completions",
                 json.dumps(completion(words(10, 7), max_tokens=450, stream=True)),
                 {"Content-Type": "application/json"})
    r = conn.getresponse()
    name = r.getheader("X-Kvpool-Engine")
    engine = setup.engines[name]
    assert r.read1(65536).startswith(b"data: ")
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    deadline = time.monotonic() + 20
    while engine.metric("vllm:num_requests_running") > 0 \
            or gw.metric("kvpool_gateway_inflight_requests", engine=name) > 0:
        assert time.monotonic() < deadline, "the request never ended"
        time.sleep(0.1)
    # The engine stopped generating when the client left, far short of the 450 tokens asked.
    assert engine.metric("vllm:generation_tokens_total") - generated[name] < 100


def test_a_trace_replayed_through_the_gateway_reports_measured_beside_predicted(setup, tmp_path):
    out = tmp_path / "replay.json"
    engines = [e.url for e in setup.engines.values()]
    r = subprocess.run(
        [sys.executable, "-m", "kvpool", "replay", str(TRACE), "--gateway", setup.gateway.url,
         "--requests", "16", "--engine-metrics", ",".join(engines),
         "--live-block-tokens", str(BLOCK), "--max-prompt-tokens", str(12 * BLOCK),
         "--vocab-size", "1000", "--time-scale", "0.5", "--max-output-tokens", "2",
         "--cache-blocks", "100", "--prefill-tokens-per-s", "2000", "--salt", "3",
         "--json", str(out), "--no-progress"],
        capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(out.read_text())
    assert report["requests"] == 16 and report["failed"] == []
    assert sum(report["per_engine"].values()) == 16 and set(report["per_engine"]) <= {"a", "b"}
    assert report["routed_by"] == {"kvpool": 16}   # the master's Route chose every engine
    m, p = report["measured"], report["predicted"]
    assert 0 < m["ttft_p50_s"] <= m["ttft_p90_s"] and 0 < p["ttft_p50_s"] <= p["ttft_p90_s"]
    # every request begins with the trace's shared first block (hash id 0): the engines served
    # it from a cache, their own or kvpool's, once its first prefill was done. The simulation
    # fills caches when a prefill finishes and looks at arrival: the ten requests that arrive
    # together at 0 s all miss there; the six at 1.5 s hit.
    assert m["prompt_tokens"] >= report["prompt_tokens"]
    assert m["local_hit_tokens"] + m["kvpool_hit_tokens"] >= 6 * BLOCK
    assert p["local_hit_tokens"] + p["kvpool_hit_tokens"] >= 6 * BLOCK
    assert "TTFT p90 (ms)" in r.stdout and "kvpool-loaded tokens" in r.stdout


def test_an_engine_killed_mid_run_fails_over(setup):
    gw = setup.gateway
    bodies = [completion(words(10, 20 + i), max_tokens=450) for i in range(4)]

    def inflight() -> dict[str, float]:
        """Requests in flight per engine, from one scrape (a request on a must still be
        running when a is killed: under load each scrape takes a while)."""
        _, _, page = gw.request("GET", "/metrics")
        found = dict.fromkeys("ab", 0.0)
        for line in page.decode().splitlines():
            if line.startswith("kvpool_gateway_inflight_requests{"):
                for e in found:
                    if f'engine="{e}"' in line:
                        found[e] += float(line.rsplit(" ", 1)[1])
        return found

    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
        # The first request is routed to whichever engine Route prefers (what each engine
        # measured of its own speed earlier in this module weighs in): once it runs there, that
        # engine is killed, and the rest are sent while it lies dead.
        futures = [pool.submit(gw.post, "/v1/completions", bodies[0])]
        deadline = time.monotonic() + 10
        while not any((now := inflight()).values()):
            assert time.monotonic() < deadline, "the first request never started"
            time.sleep(0.02)
        dead = max(now, key=now.get)
        alive = "b" if dead == "a" else "a"
        setup.engines[dead].kill()
        futures += [pool.submit(gw.post, "/v1/completions", body) for body in bodies[1:]]
        answers = [f.result(timeout=120) for f in futures]
    assert [status for status, _, _ in answers] == [200] * len(futures)
    assert [headers["x-kvpool-engine"] for _, headers, _ in answers] == [alive] * len(futures)
    assert gw.metric("kvpool_gateway_retries_total") >= 1
    status, _, health = gw.request("GET", "/health")
    assert status == 200 and json.loads(health) == {"engines": {dead: False, alive: True}}
    # The retried request's answer is the one the live engine gives it.
    for body, (_, _, via) in zip(bodies, answers):
        _, _, direct = setup.engines[alive].post("/v1/completions", body)
        assert via["choices"][0]["text"] == direct["choices"][0]["text"]
    # And later requests go to the live engine without trying the dead one.
    retries = gw.metric("kvpool_gateway_retries_total")
    for i in range(3):
        status, headers, _ = gw.post("/v1/completions", completion(words(10, 30 + i)))
        assert status == 200 and headers["x-kvpool-engine"] == alive
    assert gw.metric("kvpool_gateway_retries_total") == retries

