"""Live replay per routing policy: the first requests of a trace as real streamed requests
through ``kvpool gateway`` in front of real vLLM CPU engines, beside what ``kvpool replay``
predicts for the same scaled requests.

    python3 scripts/engines/bench_replay_gateway.py [--trace FILE] [--requests 40]
        [--start N|auto] [--multi-turn H] [--policies round_robin,least_loaded,kvpool] [--engines 2] [--model DIR]

Starts a local kvpool cluster (one node), ``--engines`` vLLM OpenAI servers (the environment of
scripts/engines/vllm-env.sh; a random model of ``--layers``/``--hidden``/``--heads`` unless
``--model``) with the kvpool connector and their KV events bridged to the master
(``kvpool kv-events``). Measures the engines' own rates first: a cold prompt's prefill on one
engine (prefill tokens/s) and the same prompt on another, which loads it from kvpool (store
tokens/s); the prediction uses them. Then per policy: a gateway with ``--policy`` in front of
the same engines and ``kvpool replay TRACE --gateway`` with a salt of its own (no run finds
another's blocks). Prints per policy TTFT p50/p90 measured and predicted, and the prompt tokens
the engines served from their own prefix cache and loaded from kvpool.
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvpool.tools.vllm_server import free_port, start_server, stop_groups, wait_healthy

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
BLOCK = 32
MAX_MODEL_LEN = 1024


def ttft_s(url: str, prompt: list[int]) -> float:
    host, port = url.split("//")[1].rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=300)
    body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": 1, "temperature": 0,
                       "stream": True})
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    r = conn.getresponse()
    first = r.read1(65536)
    seconds = time.perf_counter() - t0
    r.read()
    conn.close()
    if r.status != 200:
        raise SystemExit(f"bench: {url}: HTTP {r.status}: {first[:300]!r}")
    return seconds


def kvpool(argv: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    """A kvpool command that prints its address on its first line once it serves."""
    err = open(log, "w")   # noqa: SIM115  (the child holds it)
    proc = subprocess.Popen([sys.executable, "-m", "kvpool", *argv], stdout=subprocess.PIPE,
                            stderr=err, text=True, start_new_session=True)
    line = proc.stdout.readline()
    if not line:
        raise SystemExit(f"bench: kvpool {argv[0]} did not start:\n{log.read_text()[-3000:]}")
    return proc, line.split()[-1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", default=str(REPO / "tests/data/mooncake_conversation_trace_head.jsonl"))
    p.add_argument("--requests", type=int, default=40)
    p.add_argument("--multi-turn", type=int, metavar="H",
                   help="whole multi-turn conversations among H requests from --start "
                        "(kvpool replay --multi-turn)")
    p.add_argument("--start", default="0",
                   help="the first request replayed, or auto: the window of --requests with "
                        "the most prefix reuse (kvpool replay --start)")
    p.add_argument("--policies", default="round_robin,least_loaded,kvpool")
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--model", help="a model folder (default: build one with the sizes below)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--time-scale", type=float, default=1.0)
    p.add_argument("--max-prompt-tokens", type=int, default=MAX_MODEL_LEN - 32)
    p.add_argument("--cache-blocks", type=int, default=512,
                   help="each engine's KV cache, in blocks, for the prediction (default: 512)")
    p.add_argument("--json", help="write every run's report here")
    a = p.parse_args()
    py = subprocess.run(["bash", str(HERE / "vllm-env.sh")], check=True, text=True,
                        stdout=subprocess.PIPE).stdout.strip().splitlines()[-1]
    tmp = Path(tempfile.mkdtemp(prefix="kvpool-replay-gateway-"))
    model = a.model or str(tmp / "model")
    if not a.model:
        subprocess.run([py, str(HERE / "make_tiny_llama.py"), model, "--layers", str(a.layers),
                        "--hidden", str(a.hidden), "--heads", str(a.heads)], check=True,
                       stdout=subprocess.DEVNULL)
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    from kvpool.tools.cluster import LocalCluster
    cluster = LocalCluster(nodes=1, segment_size="512MiB", log_dir=tmp / "cluster")
    cluster.start()
    procs: list[subprocess.Popen] = []
    reports = []
    try:
        engines = []
        for k in range(a.engines):
            events = free_port()
            log = tmp / f"engine-{k}.log"
            proc, url = start_server(py, model, log, master=cluster.master, events_port=events,
                                     served_model_name="m", max_model_len=MAX_MODEL_LEN,
                                     block_tokens=BLOCK)
            procs.append(proc)
            engines.append((f"e{k}", url, events, proc, log))
        for _, url, _, proc, log in engines:
            wait_healthy(url, proc, log, timeout_s=600)
        for name, _, events, _, _ in engines:
            procs.append(kvpool(["kv-events", "--master", cluster.master, "--endpoint",
                                 f"tcp://127.0.0.1:{events}", "--instance-id", name,
                                 "--block-size", str(BLOCK), "--model", "m"],
                                tmp / f"kv-events-{name}.log")[0])
        # the engines' own rates: a cold prefill on one, the same prompt loaded on another
        rng = random.Random(0)
        n = a.max_prompt_tokens // BLOCK * BLOCK
        cold, loaded = [], []
        for i in range(4):
            prompt = [rng.randrange(100, vocab) for _ in range(n)]
            first, second = engines[i % 2][1], engines[(i + 1) % 2][1]
            cold.append(ttft_s(first, prompt))
            time.sleep(1.0)   # the saves land
            loaded.append(ttft_s(second, prompt))
        prefill_rate = n / statistics.median(cold[1:])
        store_rate = n / statistics.median(loaded[1:])
        print(f"engines: {a.engines} x vLLM CPU, model {Path(model).name} "
              f"({a.layers} layers, hidden {a.hidden}); a {n}-token prompt: cold "
              f"{statistics.median(cold[1:]) * 1e3:.0f} ms, loaded from kvpool "
              f"{statistics.median(loaded[1:]) * 1e3:.0f} ms", flush=True)
        urls = ",".join(e[1] for e in engines)
        for salt, policy in enumerate(a.policies.split(","), start=1):
            gw, url = kvpool(["gateway", "--master", cluster.master, "--model", model,
                              "--served-model-name", "m", "--policy", policy, "--port", "0",
                              "--engines", ",".join(f"{e[0]}={e[1]}" for e in engines)],
                             tmp / f"gateway-{policy}.log")
            out = tmp / f"replay-{policy}.json"
            time.sleep(1.0)
            r = subprocess.run(
                [sys.executable, "-m", "kvpool", "replay", a.trace, "--gateway", url,
                 "--requests", str(a.requests), "--start", a.start, "--engine-metrics", urls,
                 *(["--multi-turn", str(a.multi_turn)] if a.multi_turn else []),
                 "--live-block-tokens", str(BLOCK), "--max-prompt-tokens",
                 str(a.max_prompt_tokens), "--vocab-size", str(vocab), "--time-scale",
                 str(a.time_scale), "--cache-blocks", str(a.cache_blocks),
                 "--prefill-tokens-per-s", f"{prefill_rate:.0f}", "--store-tokens-per-s",
                 f"{store_rate:.0f}", "--salt", str(salt), "--json", str(out),
                 "--no-progress"], text=True, capture_output=True, check=False)
            stop_groups([gw])
            print(f"--- {policy}\n{r.stdout.strip()}", flush=True)
            if r.returncode != 0 and not out.exists():
                raise SystemExit(f"bench: replay failed:\n{r.stderr[-3000:]}")
            reports.append(json.loads(out.read_text()))
    finally:
        stop_groups(procs)
        cluster.stop()
    if reports:
        first = reports[0]
        print(f"\n{first['requests']} requests of {Path(a.trace).name} "
              + (f"(the multi-turn conversations among #{first['start']}-"
                 f"#{first['start'] + a.multi_turn - 1})" if a.multi_turn else
                 f"(#{first['start']}-#{first['start'] + a.requests - 1})")
              + f"; ideal reuse among them {first['ideal_reuse']:.1%}")
    print(f"{'policy':<14}{'TTFT p50 ms':>12}{'p90 ms':>9}{'pred p50':>10}{'pred p90':>10}"
          f"{'engine-cache tok':>18}{'kvpool tok':>12}{'pred engine':>13}{'pred kvpool':>13}")
    for r in reports:
        m, pr = r["measured"], r["predicted"]
        print(f"{r['policy']:<14}{m['ttft_p50_s'] * 1e3:>12.0f}{m['ttft_p90_s'] * 1e3:>9.0f}"
              f"{pr['ttft_p50_s'] * 1e3:>10.0f}{pr['ttft_p90_s'] * 1e3:>10.0f}"
              f"{m['local_hit_tokens']:>18,.0f}{m['kvpool_hit_tokens']:>12,.0f}"
              f"{pr['local_hit_tokens']:>13,}{pr['kvpool_hit_tokens']:>13,}")
    if a.json:
        Path(a.json).write_text(json.dumps(reports, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
