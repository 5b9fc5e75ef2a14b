"""What the gateway adds to a request's time to first token: TTFT p50 through ``kvpool gateway``
against the same engine called directly, alternating in one run.

    python3 scripts/bench_gateway.py --engine http://127.0.0.1:8000 --model DIR [--master M]

The engine is an OpenAI server already running (``vllm serve DIR ...``). Without ``--master``
the script starts a local kvpool cluster (one node) and registers the hash spec, so every
request pays for Route as in production; then it starts the gateway (a separate process, in
front of that one engine) and sends ``--requests`` streamed completions to each, alternating
which goes first. TTFT is measured by the client: from sending the request to the first body
chunk. Each request has its own random prompt (no prefix-cache hits on either path) unless
``--same-prompt``. Prints each path's p50/p90, the added p50 (gateway - direct; and the median
of the differences of each back-to-back pair, less sensitive to the machine's load drifting
during the run), and from the gateway's own log the time to choose the engine (tokenize +
Route) and the Route call alone.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from urllib.parse import urlsplit


class Target:
    """One kept-alive HTTP connection to an OpenAI server."""

    def __init__(self, url: str, model: str):
        parts = urlsplit(url)
        self.conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=120)
        self.model = model

    def ttft_s(self, prompt: list[int], max_tokens: int) -> float:
        body = json.dumps({"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
                           "temperature": 0, "stream": True, "ignore_eos": True})
        t0 = time.perf_counter()
        self.conn.request("POST", "/v1/completions", body,
                          {"Content-Type": "application/json"})
        r = self.conn.getresponse()
        first = r.read1(65536)
        ttft = time.perf_counter() - t0
        if r.status != 200 or not first.startswith(b"data: {"):
            raise SystemExit(f"bench: HTTP {r.status}: {first[:300]!r}")
        r.read()
        return ttft


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1] if len(values) > 1 else values[0]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", required=True, help="the engine's URL (an OpenAI server)")
    p.add_argument("--model", required=True, help="the model folder the engine serves")
    p.add_argument("--served-model-name", help="default: --model as given")
    p.add_argument("--master", help="a kvpool master (default: start a local cluster)")
    p.add_argument("--block-size", type=int, default=32, help="registered with a new cluster")
    p.add_argument("--requests", type=int, default=200, help="per path (default: 200)")
    p.add_argument("--prompt-tokens", type=int, default=100)
    p.add_argument("--max-tokens", type=int, default=2)
    p.add_argument("--same-prompt", action="store_true",
                   help="one prompt for every request (prefix-cache hits on both paths)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    name = a.served_model_name or a.model

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
         "--model", a.model, "--served-model-name", name, "--port", "0"],
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
    paired = [g - d for g, d in zip(ttft["gateway"], ttft["direct"])]
    print(f"added TTFT p50: {(g50 - d50) * 1e3:.2f} ms (p50 through the gateway - p50 direct); "
          f"median of the paired differences {statistics.median(paired) * 1e3:.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
