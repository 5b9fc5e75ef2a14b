"""Engine-side figures on CPU: time to first token of a prompt whose prefix another engine
process already computed and stored in kvpool, against a cold prefill, for the connector's
key schemes (vllm2: one object per block, layer by layer; vllm1: one object per layer).

    PY=$(bash scripts/engines/vllm-env.sh)
    $PY scripts/engines/bench_vllm_layerwise.py            # Llama-3.2-1B's shape, random weights
    $PY scripts/engines/bench_vllm_layerwise.py --lengths 32,512 --model /tmp/llama1b

A model with a realistic prefill cost for its KV size (built by make_tiny_llama.py
--llama-3.2-1b unless ``--model`` names one: 16 layers, hidden 2048, 32 heads, 8 KV heads,
bfloat16). One local cluster; engine processes one after another (each vLLM on CPU, its own
prefix cache off, so a repeat goes to kvpool), per key scheme:

- a *storing* engine runs one prompt of each prefix length cold (it computes every token and
  stores the prompt's blocks): the cold time to first token;
- a *loading* engine, another process, runs the same prompts: their blocks load from kvpool;
- for vllm2 a second loading engine with ``layerwise: false`` (every layer loaded before the
  forward pass starts) gives what the overlap saves.

Each prompt is ``length`` tokens of prefix (whole blocks of 32) and 8 more the engine computes;
one run each (2 shared cores make this slow: keep ``--lengths`` short). Prints a table and
the break-even prefix length: below it, loading is slower than recomputing (interpolated
between the lengths measured; "below the shortest" if loading already wins there).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
BLOCK = 32
TAIL = 8   # tokens after the prefix, always computed
MARK = "BENCH "


def prompts(lengths: list[int]) -> dict[int, list[int]]:
    """One random prompt per prefix length (the same in every process)."""
    rng = random.Random(17)
    return {n: [rng.randrange(3, 1000) for _ in range(n + TAIL)] for n in lengths}


def engine(args) -> int:
    """One engine process: a warm-up, then each prompt once; prints its times."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    lengths = [int(n) for n in args.lengths.split(",")]
    llm = LLM(model=args.model, dtype="bfloat16", max_model_len=max(lengths) + 64,
              enforce_eager=True, block_size=BLOCK, enable_prefix_caching=False, seed=0,
              kv_transfer_config={
                  "kv_connector": "KVPoolConnector",
                  "kv_connector_module_path": "kvpool.client.connectors.vllm",
                  "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                  "kv_connector_extra_config": {
                      "master": args.master, "key_scheme": args.scheme,
                      "layerwise": args.layerwise == "on", "verify": True}})
    one = SamplingParams(temperature=0.0, max_tokens=1)
    rng = random.Random(os.getpid())
    warm = [rng.randrange(3, 1000) for _ in range(200)]   # a prompt no other process has
    llm.generate([TokensPrompt(prompt_token_ids=warm)], one, use_tqdm=False)
    times = {}
    for n, tokens in prompts(lengths).items():
        t = time.perf_counter()
        [out] = llm.generate([TokensPrompt(prompt_token_ids=tokens)], one, use_tqdm=False)
        times[n] = (time.perf_counter() - t, out.num_cached_tokens or 0)
        print(MARK + json.dumps({"length": n, "seconds": times[n][0],
                                 "cached": times[n][1]}), flush=True)
    del llm
    return 0


def run_engine(model: str, master: str, scheme: str, layerwise: str, lengths: str,
               log: Path) -> dict[int, dict]:
    argv = [sys.executable, __file__, "--engine", "--model", model, "--master", master,
            "--scheme", scheme, "--layerwise", layerwise, "--lengths", lengths]
    with open(log, "w") as f:
        subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, check=True, timeout=3600)
    text = log.read_text()
    rows = {}
    for line in text.splitlines():
        if line.startswith(MARK):
            r = json.loads(line[len(MARK):])
            rows[r["length"]] = r
    # The connector's own account of each load (in request order, the warm-up loads none).
    loads = [dict(kv.split("=", 1) for kv in line.split("kvpool_kv_loaded", 1)[1].split()
                  if "=" in kv) for line in text.splitlines() if "kvpool_kv_loaded " in line]
    for r, load in zip(rows.values(), loads):
        r["load"] = load
    return rows


def break_even(lengths: list[int], cold: dict, hit: dict) -> str:
    gain = [(n, cold[n]["seconds"] - hit[n]["seconds"]) for n in lengths]
    if gain[0][1] > 0:
        return f"below {lengths[0]} tokens (loading already wins at the shortest measured)"
    for (n0, g0), (n1, g1) in itertools.pairwise(gain):
        if g0 <= 0 < g1:
            return f"~{n0 + (n1 - n0) * (-g0) / (g1 - g0):.0f} tokens"
    return f"above {lengths[-1]} tokens (recomputing wins at every length measured)"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a model folder (default: build Llama-3.2-1B's shape)")
    p.add_argument("--lengths", default="32,128,512,2048",
                   help="prefix lengths in tokens, multiples of 32, comma-separated")
    p.add_argument("--schemes", default="vllm2,vllm1")
    p.add_argument("--keep", help="a folder to keep the engines' logs in")
    p.add_argument("--engine", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--master", help=argparse.SUPPRESS)
    p.add_argument("--scheme", help=argparse.SUPPRESS)
    p.add_argument("--layerwise", default="on", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.engine:
        return engine(a)
    lengths = sorted(int(n) for n in a.lengths.split(","))
    if any(n <= 0 or n % BLOCK for n in lengths):
        p.error(f"--lengths: positive multiples of {BLOCK}")
    with tempfile.TemporaryDirectory(prefix="kvpool-bench-layerwise-") as tmp:
        logs = Path(a.keep or tmp)
        logs.mkdir(parents=True, exist_ok=True)
        model = a.model
        if model is None:
            model = str(Path(tmp) / "llama-3.2-1b-shape")
            print("building a random model of Llama-3.2-1B's shape", file=sys.stderr)
            subprocess.run([sys.executable, str(HERE / "make_tiny_llama.py"), model,
                            "--llama-3.2-1b"], check=True, stdout=subprocess.DEVNULL)
        from kvpool.tools.cluster import LocalCluster
        results = {}
        with LocalCluster(nodes=1, segment_size="2GiB", log_dir=logs / "cluster") as c:
            runs = []
            for scheme in a.schemes.split(","):
                runs += [(scheme, "store", "on"), (scheme, "load", "on")]
                if scheme == "vllm2":
                    runs.append((scheme, "load", "off"))
            for scheme, role, layerwise in runs:
                print(f"engine: {scheme} {role} layerwise={layerwise}", file=sys.stderr)
                results[scheme, role, layerwise] = run_engine(
                    model, c.master, scheme, layerwise, ",".join(map(str, lengths)),
                    logs / f"{scheme}-{role}-{layerwise}.log")
                if role == "store":
                    time.sleep(3.0)   # the background saves land
        report(lengths, results)
    return 0


def report(lengths: list[int], results: dict) -> None:
    def load(row: dict, field: str) -> float:
        return float(row.get("load", {}).get(field, "nan"))

    print(f"{'scheme':<7} {'prefix':>6}  {'cold s':>7}  {'loaded s':>8}  {'speed-up':>8}  "
          f"{'loaded':>6}  {'load s':>7}  {'added s':>7}  {'all-first s':>11}  {'added s':>7}")
    for scheme in sorted({k[0] for k in results}, reverse=True):
        cold, hit = results[scheme, "store", "on"], results[scheme, "load", "on"]
        before = results.get((scheme, "load", "off"), {})
        for n in lengths:
            first = f"{before[n]['seconds']:>11.3f}  {load(before[n], 'waited_s'):>7.3f}" \
                if n in before else f"{'-':>11}  {'-':>7}"
            added = load(hit[n], "waited_s") if scheme == "vllm2" else load(hit[n], "seconds")
            print(f"{scheme:<7} {n:>6}  {cold[n]['seconds']:>7.3f}  {hit[n]['seconds']:>8.3f}  "
                  f"{cold[n]['seconds'] / hit[n]['seconds']:>7.1f}x  {hit[n]['cached']:>6}  "
                  f"{load(hit[n], 'seconds'):>7.3f}  {added:>7.3f}  {first}")
        print(f"{scheme}: break-even prefix length {break_even(lengths, cold, hit)}")
    print("cold: the storing engine's own prefill of the prompt (connector on, nothing to load);"
          " loaded: another engine process, the prefix loaded from kvpool; loaded: tokens "
          "loaded; load s: the connector's load, first lookup to last layer in place; added s: "
          "what the load held the forward pass (vllm2: wait_for_layer_load, all layers "
          "together; vllm1: the whole load, before the forward pass); all-first: vllm2 with "
          "layerwise off (every layer loaded before the forward pass) and what that added")


if __name__ == "__main__":
    sys.exit(main())
