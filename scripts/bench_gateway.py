"""What the gateway adds to a request's time to first token: TTFT p50 through ``kvpool gateway``
against the same engine called directly, alternating in one run.

    python3 scripts/bench_gateway.py --engine http://127.0.0.1:8000 --model DIR [--master M]
    python3 scripts/bench_gateway.py --start-vllm      # all of it here: the issue's figure

The engine is an OpenAI server already running (``vllm serve DIR ...``), or with
``--start-vllm`` one the script starts: a local kvpool cluster, a tiny Llama made in a temporary
folder (scripts/engines/make_tiny_llama.py) and a real vLLM on CPU in front of it, with the
kvpool connector and its KV events (the venv of scripts/engines/vllm-env.sh, built once, ~3
min; the engine takes ~1 min to start). Without ``--master``
the script starts a local kvpool cluster (one node) and registers the hash spec, so every
request pays for Route as in production; then it starts the gateway (a separate process, in
front of that one engine) and sends ``--requests`` streamed completions to each, alternating
which goes first. TTFT is measured by the client: from sending the request to the first body
chunk. Each request has its own random prompt (no prefix-cache hits on either path) unless
``--same-prompt``. Prints each path's p50/p90, the added p50 (gateway - direct; and the median
of the differences of each back-to-back pair, less sensitive to the machine's load drifting
during the run), and from the gateway's own log the time to choose the engine (tokenize +
Route) and the Route call alone.

Disaggregated prefill and decode against colocated serving on the same engines::

    python3 scripts/bench_gateway.py --prefill URL --decode URL --master M --model DIR

P (``kv_role: kv_producer``) and D (``kv_consumer``) run with the kvpool connector on master
M. The two paths, alternating: ``colocated``, each request sent whole to P (a producer computes
every token itself, as a colocated engine does), and ``disaggregated``, through a gateway
started with ``--prefill P --decode D`` (P computes the prompt and stores its KV, D loads it and
generates). Prints each path's TTFT and time per output token (TPOT: from the first token to
the last, over the tokens after the first) p50/p90. ``--concurrency K`` sends rounds of K
requests at once (prefills then land between other requests' decode steps).
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import contextlib
import http.client
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

HERE = Path(__file__).resolve().parent


class Target:
    """One kept-alive HTTP connection to an OpenAI server."""

    def __init__(self, url: str, model: str):
        parts = urlsplit(url)
        self.conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=120)
        self.model = model
        self.last_used = 0.0

    def ttft_s(self, prompt: list[int], max_tokens: int) -> float:
        return self.times_s(prompt, max_tokens)[0]

    def times_s(self, prompt: list[int], max_tokens: int) -> tuple[float, float | None]:
        """(TTFT, TPOT): TPOT from the first chunk to the last one before ``[DONE]``, over the
        ``max_tokens - 1`` tokens after the first (``ignore_eos``: all of them come); None
        for one token."""
        body = json.dumps({"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
                           "temperature": 0, "stream": True, "ignore_eos": True})
        if time.monotonic() - self.last_used > 2.0:
            # vLLM's server drops a connection idle for 5 s: start a new one, outside the time.
            self.conn.close()
            self.conn.connect()
        t0 = time.perf_counter()
        self.conn.request("POST", "/v1/completions", body,
                          {"Content-Type": "application/json"})
        r = self.conn.getresponse()
        first = r.read1(65536)
        ttft = time.perf_counter() - t0
        if r.status != 200 or not first.startswith(b"data: {"):
            raise SystemExit(f"bench: HTTP {r.status}: {first[:300]!r}")
        last = ttft
        while chunk := r.read1(65536):
            if chunk.strip() != b"data: [DONE]":
                last = time.perf_counter() - t0
        self.last_used = time.monotonic()
        return ttft, (last - ttft) / (max_tokens - 1) if max_tokens > 1 else None


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1] if len(values) > 1 else values[0]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", help="the engine's URL (an OpenAI server)")
    p.add_argument("--stand-in", action="store_true",
                   help="start a stand-in engine that answers at once (scripts/stand_in_engine"
                        ".py) and measure against it: the gateway's own overhead")
    p.add_argument("--start-vllm", action="store_true",
                   help="start a kvpool cluster and a real vLLM (CPU, a tiny Llama) and "
                        "measure against it")
    p.add_argument("--prefill", help="disaggregated: the prefill engine's URL (kv_producer)")
    p.add_argument("--decode", help="disaggregated: the decode engine's URL (kv_consumer)")
    p.add_argument("--model", help="the model folder the engine serves (with --stand-in: "
                   "default, the tiny Llama's tokenizer, built in a temporary folder)")
    p.add_argument("--served-model-name", help="default: --model as given")
    p.add_argument("--master", help="a kvpool master (default: start a local cluster)")
    p.add_argument("--block-size", type=int, default=32, help="registered with a new cluster")
    p.add_argument("--requests", type=int, default=200, help="per path (default: 200)")
    p.add_argument("--prompt-tokens", type=int, default=100)
    p.add_argument("--max-tokens", type=int, default=2)
    p.add_argument("--same-prompt", action="store_true",
                   help="one prompt for every request (prefix-cache hits on both paths)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--concurrency", type=int, default=1,
                   help="disaggregated: requests sent at once per round (default: 1)")
    p.add_argument("--probe-interval", default="1s",
                   help="the gateway's --probe-interval (its scrapes of each engine's /metrics)")
    p.add_argument("--engine-cpus", metavar="CPUS",
                   help="with --start-vllm: the cores vLLM runs on (taskset list, e.g. 0), "
                        "its OpenMP threads bound there; the gateway, the cluster and this "
                        "client then have the others, as on separate hosts (default: vLLM "
                        "binds every core)")
    p.add_argument("--gateway-args", default="",
                   help="more arguments for the gateway, e.g. '--event-loop asyncio'")
    a = p.parse_args()
    if a.prefill or a.decode:
        if not (a.prefill and a.decode and a.master and a.model) or a.engine or a.stand_in:
            p.error("disaggregated: give --prefill, --decode, --master (the engines' "
                    "master) and --model, not --engine")
        return disaggregated(a, a.served_model_name or a.model)
    if (bool(a.engine) + a.stand_in + a.start_vllm) != 1:
        p.error("give one of --engine URL, --stand-in, --start-vllm, or --prefill URL "
                "--decode URL --master M")
    if a.model is None and a.engine:
        p.error("give --model DIR: the engine's model folder")
    if a.engine_cpus and not a.start_vllm:
        p.error("--engine-cpus goes with --start-vllm (pin an engine you start yourself)")
    if a.start_vllm and (a.model or a.master):
        p.error("--start-vllm makes its own model and cluster: give neither --model nor "
                "--master")
    with contextlib.ExitStack() as stack:
        if a.start_vllm:
            a.engine, a.model, a.master = stack.enter_context(vllm_engine(a.engine_cpus))
            a.served_model_name = "tiny"
        if a.stand_in:
            a.engine = stack.enter_context(stand_in())
            if a.model is None:
                a.model = stack.enter_context(tokenizer_only())
        name = a.served_model_name or a.model
        return colocated(a, name)


@contextlib.contextmanager
def stand_in():
    """A stand-in engine process (answers at once); yields its URL."""
    proc = subprocess.Popen([sys.executable, str(HERE / "stand_in_engine.py")],
                            stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        if not line.startswith("stand-in: "):
            raise SystemExit(f"bench: the stand-in engine did not start: {line!r}")
        yield line.split()[1]
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@contextlib.contextmanager
def vllm_engine(cpus: str | None = None):
    """A local kvpool cluster and a real vLLM on CPU (a tiny Llama, the kvpool connector, its
    KV events to the cluster's master), on ``cpus`` if given; yields the engine's URL, the
    model folder and the master."""
    from kvpool.client.router import RouterClient
    from kvpool.common.hashing import HashSpec
    from kvpool.tools import vllm_server
    from kvpool.tools.cluster import LocalCluster
    python = subprocess.run(["bash", str(HERE / "engines" / "vllm-env.sh")], check=True,
                            stdout=subprocess.PIPE, text=True).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="bench-gateway-vllm-") as tmp, \
            LocalCluster(nodes=1, segment_size="64MiB", log_dir=Path(tmp) / "cluster") as c:
        model = Path(tmp) / "tiny-llama"
        print("bench: making the tiny Llama, starting vLLM (~1 min)", file=sys.stderr)
        subprocess.run([python, str(HERE / "engines" / "make_tiny_llama.py"), str(model)],
                       check=True, capture_output=True, timeout=300)
        log = Path(tmp) / "engine.log"
        proc, url = vllm_server.start_server(
            python, str(model), log, cpus=cpus, master=c.master,
            events_port=vllm_server.free_port(), served_model_name="tiny", max_model_len=512,
            timeout_s=2.0)
        try:
            vllm_server.wait_healthy(url, proc, log, 300)
            with RouterClient(c.master) as router:    # as a serving set-up would have
                router.register(HashSpec.of(vllm_server.BLOCK_TOKENS, model="tiny"))
            yield url, str(model), c.master
        finally:
            vllm_server.stop_groups([proc])


@contextlib.contextmanager
def tokenizer_only():
    """The tiny Llama's tokenizer and chat template in a temporary folder (no torch needed)."""
    with tempfile.TemporaryDirectory(prefix="bench-gateway-tok-") as out:
        subprocess.run([sys.executable, str(HERE / "engines" / "make_tiny_llama.py"), out,
                        "--tokenizer-only"], check=True, capture_output=True, timeout=120)
        yield out


def colocated(a: argparse.Namespace, name: str) -> int:

    cluster = None
    if a.master is None:
        from kvpool.client.router import RouterClient
        from kvpool.common.hashing import HashSpec
        from kvpool.tools.cluster import LocalCluster
        cluster = LocalCluster(nodes=1, segment_size="64MiB")
        cluster.start()
        a.master = cluster.master
        with RouterClient(a.master) as router:
            router.register(HashSpec.of(a.block_size, model=name))
    log = tempfile.TemporaryFile("w+")  # noqa: SIM115  (a pipe would fill up and stall the gateway)
    gw = subprocess.Popen(
        [sys.executable, "-m", "kvpool", "gateway", "--master", a.master, "--engines", a.engine,
         "--model", a.model, "--served-model-name", name, "--port", "0",
         "--probe-interval", a.probe_interval, *shlex.split(a.gateway_args)],
        stdout=subprocess.PIPE, stderr=log, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        line = gw.stdout.readline()
        if not line.startswith("gateway: "):
            log.seek(0)
            raise SystemExit(f"bench: the gateway did not start: {line}{log.read()}")
        gateway_url = line.split()[1]
        rng = random.Random(a.seed)
        fixed = [rng.randrange(3, 1000) for _ in range(a.prompt_tokens)]
        paths = {"direct": Target(a.engine, name), "gateway": Target(gateway_url, name)}
        ttft: dict[str, list[float]] = {"direct": [], "gateway": []}
        for path in paths.values():          # warm both connections and the engine
            for _ in range(5):
                path.ttft_s(fixed, a.max_tokens)
        for i in range(a.requests):
            order = ["direct", "gateway"] if i % 2 == 0 else ["gateway", "direct"]
            for which in order:
                prompt = fixed if a.same_prompt else \
                    [rng.randrange(3, 1000) for _ in range(a.prompt_tokens)]
                ttft[which].append(paths[which].ttft_s(prompt, a.max_tokens))
    finally:
        gw.terminate()
        gw.wait(timeout=30)
        log.seek(0)
        err = log.read()
        if cluster is not None:
            cluster.stop()
    served = [dict(f.split("=", 1) for f in row.split() if "=" in f)
              for row in err.splitlines() if "request_served" in row]
    d50, g50 = pct(ttft["direct"], 50), pct(ttft["gateway"], 50)
    print(f"requests: {a.requests} per path, alternating; prompt {a.prompt_tokens} tokens "
          f"({'one prompt' if a.same_prompt else 'a new prompt each'}), {a.max_tokens} out")
    for which, v in ttft.items():
        print(f"{which:8s} TTFT p50 {pct(v, 50) * 1e3:8.2f} ms   p90 {pct(v, 90) * 1e3:8.2f} ms")
    for field, what in (("plan_s", "arrival to engine chosen (tokenize + Route)"),
                        ("ttft_s", "arrival to the engine's first chunk"),
                        ("route_s", "the Route call")):
        values = [float(row[field]) for row in served if field in row]
        if values:
            print(f"gateway {what}: p50 {statistics.median(values) * 1e3:.2f} ms "
                  f"(its log, {len(values)} requests)")
    policies = collections.Counter(row.get("policy", "?") for row in served)
    print("policies that chose the engine: " + ", ".join(f"{p} {n}" for p, n in policies.most_common())
          + ("  (fallback: Route was not asked)" if "fallback_least_loaded" in policies
             else ""))
    for row in err.splitlines():
        if "route_unavailable" in row:
            print(f"gateway: {row.strip()}")
            break
    paired = [g - d for g, d in zip(ttft["gateway"], ttft["direct"])]
    print(f"added TTFT p50: {(g50 - d50) * 1e3:.2f} ms (p50 through the gateway - p50 direct); "
          f"median of the paired differences {statistics.median(paired) * 1e3:.2f} ms")
    return 0


def start_gateway(args: list[str]) -> tuple[subprocess.Popen, str, object]:
    log = tempfile.TemporaryFile("w+")  # noqa: SIM115  (a pipe would fill up and stall the gateway)
    gw = subprocess.Popen([sys.executable, "-m", "kvpool", "gateway", *args, "--port", "0"],
                          stdout=subprocess.PIPE, stderr=log, text=True,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    line = gw.stdout.readline()
    if not line.startswith("gateway: "):
        gw.kill()
        log.seek(0)
        raise SystemExit(f"bench: the gateway did not start: {line}{log.read()}")
    return gw, line.split()[1], log


def disaggregated(a: argparse.Namespace, name: str) -> int:
    gw, url, log = start_gateway(["--master", a.master, "--prefill", a.prefill, "--decode",
                                  a.decode, "--model", a.model, "--served-model-name", name,
                                  "--probe-interval", a.probe_interval])
    rng = random.Random(a.seed)
    urls = {"colocated": a.prefill, "disaggregated": url}
    times: dict[str, list[tuple[float, float | None]]] = {k: [] for k in urls}
    k = a.concurrency
    # One kept-alive connection per client and path; a new prompt each request (no engine
    # holds it yet). Rounds alternate the paths: each round, ``k`` clients send one request
    # each at once, then wait for all (with k > 1, prefills land between other requests'
    # decode steps, which is what disaggregation keeps off the decode engine).
    clients = {w: [Target(u, name) for _ in range(k)] for w, u in urls.items()}

    def one_round(which: str) -> list[tuple[float, float | None]]:
        prompts = [[rng.randrange(3, 1000) for _ in range(a.prompt_tokens)] for _ in range(k)]
        with concurrent.futures.ThreadPoolExecutor(k) as pool:
            return list(pool.map(lambda c, p: c.times_s(p, a.max_tokens), clients[which],
                                 prompts))
    try:
        for which in urls:               # warm the connections and both engines
            one_round(which)
        for i in range(max(1, a.requests // k)):
            for which in (list(urls) if i % 2 == 0 else list(urls)[::-1]):
                times[which] += one_round(which)
    finally:
        gw.terminate()
        gw.wait(timeout=30)
    print(f"requests: {len(times['colocated'])} per path, in rounds of {k} at once, the paths "
          f"alternating; prompt {a.prompt_tokens} tokens (a new prompt each), "
          f"{a.max_tokens} out")
    for which, v in times.items():
        ttft = [t for t, _ in v]
        tpot = [t for _, t in v if t is not None]
        print(f"{which:14s} TTFT p50 {pct(ttft, 50) * 1e3:8.2f} ms  p90 {pct(ttft, 90) * 1e3:8.2f}"
              f" ms   TPOT p50 {pct(tpot, 50) * 1e3:7.2f} ms  p90 {pct(tpot, 90) * 1e3:7.2f} ms")
    log.seek(0)
    served = [dict(f.split("=", 1) for f in row.split() if "=" in f)
              for row in log.read().splitlines() if "request_served" in row]
    prefill = [float(r["prefill_s"]) for r in served if "prefill_s" in r]
    if prefill:
        print(f"disaggregated: arrival to the prefill's answer p50 "
              f"{statistics.median(prefill) * 1e3:.2f} ms (the gateway's log)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
