"""Prefill time of a real vLLM (CPU) with and without a kvpool prefix hit, in one process.

    PY=$(bash scripts/engines/vllm-env.sh)
    $PY scripts/engines/bench_vllm.py                     # a random 8-layer, hidden-1024 Llama
    $PY scripts/engines/bench_vllm.py --layers 2 --hidden 128 --heads 2   # the tests' tiny one

Starts a local cluster (1 store node) and one engine with KVPoolConnector and vLLM's own prefix
cache off, so every repeat of a prompt goes to kvpool. Stores ``--prompts`` prompts of
``--blocks`` full blocks (+8 tokens) with a cold pass, then alternates a new prompt (cold: every
token computed) with a stored one (hit: all full blocks loaded) and prints the median time to
the first token of each, the ratio, and the KV bytes a hit moves. Both kinds run in the same
warmed-up engine, so they differ only in the prefill work and the load.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
BLOCK = 32


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a model folder (default: build one with the sizes below)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--blocks", type=int, default=14, help="full blocks per prompt (of 32 tokens)")
    p.add_argument("--prompts", type=int, default=6, help="stored prompts (= hit requests)")
    p.add_argument("--verify", choices=["on", "off"], default="on")
    a = p.parse_args()
    if (a.blocks + 1) * BLOCK > 512:
        p.error("--blocks: at most 15 (max_model_len 512)")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

    with tempfile.TemporaryDirectory(prefix="kvpool-bench-vllm-") as tmp:
        model = a.model
        if model is None:
            model = str(Path(tmp) / "model")
            print(f"building a random Llama: {a.layers} layers, hidden {a.hidden}, "
                  f"{a.heads} heads", file=sys.stderr)
            subprocess.run([sys.executable, str(HERE / "make_tiny_llama.py"), model,
                            "--layers", str(a.layers), "--hidden", str(a.hidden),
                            "--heads", str(a.heads)], check=True, stdout=subprocess.DEVNULL)
        from kvpool.tools.cluster import LocalCluster
        with LocalCluster(nodes=1, segment_size="2GiB", log_dir=Path(tmp) / "logs") as c:
            return run(a, model, c.master)


def run(a, model: str, master: str) -> int:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model, dtype="float32", max_model_len=512, enforce_eager=True,
              block_size=BLOCK, enable_prefix_caching=False, seed=0,
              kv_transfer_config={
                  "kv_connector": "KVPoolConnector",
                  "kv_connector_module_path": "kvpool.client.connectors.vllm",
                  "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                  "kv_connector_extra_config": {"master": master, "verify": a.verify == "on"}})
    one = SamplingParams(temperature=0.0, max_tokens=1)
    rng = random.Random(0)

    def prompt() -> list[int]:
        return [rng.randrange(3, 1000) for _ in range(a.blocks * BLOCK + 8)]

    def ttft(tokens: list[int]) -> tuple[float, int]:
        t = time.perf_counter()
        [out] = llm.generate([TokensPrompt(prompt_token_ids=tokens)], one, use_tqdm=False)
        return time.perf_counter() - t, out.num_cached_tokens or 0

    for _ in range(3):
        ttft(prompt())                               # warm-up
    stored = [prompt() for _ in range(a.prompts)]
    for s in stored:
        ttft(s)                                      # computes and stores
    time.sleep(2.0)                                  # the background saves land
    cold, hit, hit_tokens = [], [], []
    for s in stored:
        cold.append(ttft(prompt())[0])
        seconds, cached = ttft(s)
        hit.append(seconds)
        hit_tokens.append(cached)
    cfg = llm.llm_engine.model_config.hf_config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    block_bytes = 2 * cfg.num_key_value_heads * head_dim * BLOCK * 4 * cfg.num_hidden_layers
    c_ms, h_ms = statistics.median(cold) * 1e3, statistics.median(hit) * 1e3
    print(f"model: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
          f"{cfg.num_key_value_heads} KV heads; prompt {a.blocks * BLOCK + 8} tokens "
          f"({a.blocks} full blocks of {BLOCK}); verify={a.verify}")
    print(f"hits: {sum(t == a.blocks * BLOCK for t in hit_tokens)}/{len(hit_tokens)} requests "
          f"loaded all {a.blocks} blocks")
    print(f"time to first token, median of {len(cold)}: cold {c_ms:.1f} ms, "
          f"kvpool hit {h_ms:.1f} ms ({c_ms / h_ms:.2f}x faster)")
    print(f"KV moved per hit: {a.blocks * block_bytes / 2**20:.2f} MiB "
          f"({block_bytes / 2**10:.0f} KiB per block, all layers)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
