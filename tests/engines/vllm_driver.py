"""One vLLM engine process for tests/engines/test_vllm.py, driven over stdin/stdout.

Run with the engine venv's Python (scripts/engines/vllm-env.sh). Starts ``LLM(model)`` on CPU,
with KVPoolConnector when ``--master`` is given, prints ``DRIVER {"ready": ...}``, then for each
stdin line ``{"prompt": [token ids], "max_tokens": N}`` generates greedily and prints
``DRIVER {"tokens": [...], "seconds": S, "cached_tokens": C}``; ``{"keys": [token ids]}`` answers
the store keys of those tokens' full blocks, ``{"metrics": true}`` the connector's
``kvpool_client_*`` samples. EOF or ``quit`` shuts the engine
down (flushing the connector's saves) and exits. Everything else on stdout is vLLM's log; the
engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so the log lines of a
request come before its DRIVER line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

MARK = "DRIVER "
BLOCK_SIZE = 32


def _say(obj: dict) -> None:
    # One write, newline included: print() writes the newline apart, and a log line from
    # another thread (the connector's) landed between the two once (CI, session 15).
    sys.stdout.write(MARK + json.dumps(obj) + "\n")
    sys.stdout.flush()


def block_keys(model: str, prompt: list[int], version: int = 2) -> list[str]:
    """The store keys of ``prompt``'s full blocks as the key scheme documents them, computed
    here from vLLM's own block hash (sha256, default seed) rather than taken from the connector:
    block-major (version 1: each block's layers in order; the tiny Llama: 2 layers, float32,
    TP 1)."""
    from kvpool.client.connectors.vllm_keys import VLLMKeyScheme
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils

    fn = get_hash_fn_by_name("sha256")
    kv_cache_utils.init_none_hash(fn)
    scheme = VLLMKeyScheme(model=model, kv_dtype="float32", block_size=BLOCK_SIZE, tp_size=1,
                           hash_algo="sha256",
                           layer_names=tuple(f"model.layers.{i}.self_attn.attn" for i in range(2)),
                           version=version)
    hashes, parent = [], None
    for start in range(0, len(prompt) - BLOCK_SIZE + 1, BLOCK_SIZE):
        parent = kv_cache_utils.hash_block_tokens(fn, parent, prompt[start:start + BLOCK_SIZE])
        hashes.append(parent)
    return scheme.prefix_keys(hashes)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", required=True)
    p.add_argument("--master", help="kvpool master; without it no connector")
    p.add_argument("--verify", choices=["on", "off"], default="on")
    p.add_argument("--prefix-caching", choices=["on", "off"], default="on")
    p.add_argument("--timeout-s", type=float, default=2.0)
    p.add_argument("--transports", help="kvpool transports, e.g. tcp (default: all)")
    p.add_argument("--key-scheme", choices=["vllm1", "vllm2"], default="vllm2")
    p.add_argument("--layerwise", choices=["on", "off"], default="on")
    p.add_argument("--kv-events", metavar="ENDPOINT",
                   help="publish vLLM's KV events on this ZMQ endpoint (e.g. tcp://*:5557)")
    args = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw = {}
    if args.master:
        kw["kv_transfer_config"] = {
            "kv_connector": "KVPoolConnector",
            "kv_connector_module_path": "kvpool.client.connectors.vllm",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"master": args.master, "verify": args.verify == "on",
                                          "timeout_s": args.timeout_s, "retry_s": 5,
                                          "key_scheme": args.key_scheme,
                                          "layerwise": args.layerwise == "on"},
        }
        if args.transports:
            kw["kv_transfer_config"]["kv_connector_extra_config"]["transports"] = args.transports
    if args.kv_events:
        kw["kv_events_config"] = {"enable_kv_cache_events": True, "publisher": "zmq",
                                  "endpoint": args.kv_events}
    t0 = time.perf_counter()
    llm = LLM(model=args.model, dtype="float32", max_model_len=512, enforce_eager=True,
              block_size=BLOCK_SIZE, enable_prefix_caching=args.prefix_caching == "on", seed=0, **kw)
    _say({"ready": True, "startup_s": round(time.perf_counter() - t0, 2)})
    for line in sys.stdin:
        line = line.strip()
        if not line or line == "quit":
            break
        req = json.loads(line)
        if "keys" in req:
            _say({"keys": block_keys(args.model, req["keys"], int(args.key_scheme[-1]))})
            continue
        if "metrics" in req:   # what the connector counted in this process's registry
            from prometheus_client import REGISTRY
            _say({"metrics": [[m.name, m.labels, m.value] for f in REGISTRY.collect()
                              for m in f.samples if m.name.startswith("kvpool_client_")]})
            continue
        params = SamplingParams(temperature=0.0, max_tokens=req.get("max_tokens", 8),
                                ignore_eos=True)
        t = time.perf_counter()
        [out] = llm.generate([TokensPrompt(prompt_token_ids=req["prompt"])], params,
                             use_tqdm=False)
        _say({"tokens": list(out.outputs[0].token_ids),
              "seconds": round(time.perf_counter() - t, 4),
              "cached_tokens": out.num_cached_tokens or 0})
    t = time.perf_counter()
    del llm     # shuts the engine down; the connector flushes its saves
    import gc
    gc.collect()
    _say({"bye": True, "shutdown_s": round(time.perf_counter() - t, 2)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
