"""``kvpool demo``: serving instances sharing prompt-prefix KV through a kvpool cluster.

Each instance is its own process with its own KVClient, as real prefill workers would be. For
each request it hashes the prompt into chained 16-token blocks (``kvpool.client.blocks``, spec
``kvpool-sha256-v1``), loads the longest cached prefix
from the pool (verifying every byte), "prefills" the rest (fills the block with bytes derived
from its hash, standing in for the model) and stores the new blocks for everyone else.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field

import numpy as np
from kvpool.common.config import format_size, parse_size
from kvpool.tools.argtypes import count_type, master_arg, size_type

BLOCK_TOKENS = 16


def fake_kv(key: str, out: np.ndarray) -> None:
    """Fill ``out`` (uint64) with the block's stand-in KV: distinct per block and position."""
    seed = np.uint64(int(key[-16:], 16))
    np.bitwise_xor(np.arange(out.size, dtype=np.uint64), seed, out=out)


@dataclass
class InstanceStats:
    requests: int = 0
    prompt_tokens: int = 0
    blocks: int = 0
    hit_blocks: int = 0
    bytes_read: int = 0
    read_s: float = 0.0
    bytes_written: int = 0
    write_s: float = 0.0
    wrong_blocks: int = 0
    errors: list[str] = field(default_factory=list)


def _instance(master: str, prompts: list[list[int]], block_bytes: int, out: mp.Queue) -> None:
    from kvpool.client import KVClient
    from kvpool.client.blocks import TokenBlocks
    from kvpool.common.errors import AlreadyExists, KVPoolError
    from kvpool.common.hashing import HashSpec
    stats = InstanceStats()
    words = block_bytes // 8
    expected = np.empty(words, dtype=np.uint64)
    try:
        with KVClient(master=master) as kv:
            blocks = TokenBlocks(kv, HashSpec.of(BLOCK_TOKENS, model="llama-3-8b"))
            for tokens in prompts:
                keys = blocks.keys(tokens)
                cache = np.empty((len(keys), words), dtype=np.uint64)  # this request's KV pages
                hit = blocks.cached_prefix(tokens)
                t0 = time.perf_counter()
                # A block evicted since the lookup ends the usable prefix: the rest is prefilled.
                hit = blocks.get_prefix(tokens, list(cache[:hit]))
                stats.read_s += time.perf_counter() - t0
                stats.bytes_read += hit * block_bytes
                for i in range(hit):
                    fake_kv(keys[i], expected)
                    stats.wrong_blocks += not np.array_equal(expected, cache[i])
                for i in range(hit, len(keys)):
                    fake_kv(keys[i], cache[i])   # the "prefill" of blocks nobody had
                t0 = time.perf_counter()
                res = kv.batch_put(keys[hit:], list(cache[hit:]))
                stats.write_s += time.perf_counter() - t0
                for r in res:
                    if r is None:
                        stats.bytes_written += block_bytes
                    elif not isinstance(r, AlreadyExists):   # another instance was faster
                        stats.errors.append(f"put: {r}")
                stats.requests += 1
                stats.prompt_tokens += len(tokens)
                stats.blocks += len(keys)
                stats.hit_blocks += hit
    except KVPoolError as e:
        stats.errors.append(f"{type(e).__name__}: {e}")
    out.put(stats)


def make_workload(instances: int, requests: int, prefixes: int, prefix_tokens: int,
                  seed: int) -> list[list[list[int]]]:
    """Per instance, its prompts: a shared system prompt, sometimes an earlier conversation
    (multi-turn: the previous prompt plus a new turn), and a new user turn."""
    rng = random.Random(seed)
    systems = [[rng.randrange(128_000) for _ in range(prefix_tokens)] for _ in range(prefixes)]
    history: list[list[int]] = []
    per_instance: list[list[list[int]]] = [[] for _ in range(instances)]
    for r in range(instances * requests):
        turn = [rng.randrange(128_000) for _ in range(rng.randrange(64, 257))]
        if history and rng.random() < 0.3:
            prompt = rng.choice(history) + turn
        else:
            prompt = rng.choice(systems) + turn
        history.append(prompt)
        per_instance[r % instances].append(prompt)
    return per_instance


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = ("Start a local cluster (unless --master is given), run several simulated "
                     "serving instances that share prompt prefixes through kvpool with "
                     "Llama-3-8B-sized KV blocks, print hits, prefill tokens saved, bytes moved "
                     "and GB/s, then stop.")
    master_arg(p, required=False)
    p.add_argument("--instances", type=count_type, default=4, help="serving instances (processes) "
                   "(default: 4)")
    p.add_argument("--requests", type=count_type, default=12, help="requests per instance (default: 12)")
    p.add_argument("--prefixes", type=count_type, default=3,
                   help="distinct shared system prompts (default: 3)")
    p.add_argument("--prefix-tokens", type=count_type, default=1024,
                   help="tokens in each shared prefix (default: 1024)")
    p.add_argument("--block-bytes", type=size_type, default=parse_size("2MiB"), metavar="SIZE",
                   help="KV bytes per 16-token block (default: 2MiB, Llama-3-8B in bf16)")
    p.add_argument("--seed", type=int, default=0, help="workload seed (default: 0)")


def run(args: argparse.Namespace) -> int:
    from kvpool.tools.cluster import LocalCluster
    if args.block_bytes % 8:
        print("kvpool demo: error: --block-bytes must be a multiple of 8", file=sys.stderr)
        return 2
    cluster = None
    master = args.master
    with tempfile.TemporaryDirectory(prefix="kvpool-demo-") as logs:
        if not master:
            print("starting a local cluster: 1 master, 2 store nodes with 1 GiB each ...", flush=True)
            cluster = LocalCluster(nodes=2, segment_size="1GiB", log_dir=logs)
            master = cluster.start()
        try:
            print(f"master: {master}", flush=True)
            return _run(args, master)
        finally:
            if cluster:
                cluster.stop()
                print("local cluster stopped", flush=True)


def _run(args, master: str) -> int:
    from kvpool.rpc.master_client import MasterClient
    workload = make_workload(args.instances, args.requests, args.prefixes, args.prefix_tokens,
                             args.seed)
    print(f"{args.instances} instances x {args.requests} requests, {args.prefixes} shared "
          f"prefixes of {args.prefix_tokens} tokens, {format_size(args.block_bytes)} of KV per "
          f"{BLOCK_TOKENS}-token block", flush=True)
    ctx = mp.get_context("spawn")   # never fork a process that may hold a gRPC channel
    queue = ctx.Queue()
    t0 = time.perf_counter()
    procs = [ctx.Process(target=_instance, args=(master, prompts, args.block_bytes, queue))
             for prompts in workload]
    for p in procs:
        p.start()
    results: list[InstanceStats] = []
    for _ in procs:
        s = queue.get(timeout=600)
        results.append(s)
        print(f"  instance done: {s.requests} requests, {s.hit_blocks}/{s.blocks} blocks from "
              f"the pool", flush=True)
    for p in procs:
        p.join()
    wall_s = time.perf_counter() - t0
    tot = InstanceStats()
    for s in results:
        for f in ("requests", "prompt_tokens", "blocks", "hit_blocks", "bytes_read", "read_s",
                  "bytes_written", "write_s", "wrong_blocks"):
            setattr(tot, f, getattr(tot, f) + getattr(s, f))
        tot.errors += s.errors
    mc = MasterClient(master)
    try:
        st = mc.stats()
    finally:
        mc.close()
    saved = tot.hit_blocks * BLOCK_TOKENS
    print(f"\nrequests                {tot.requests} in {wall_s:.1f}s")
    print(f"blocks from the pool    {tot.hit_blocks}/{tot.blocks} "
          f"({tot.hit_blocks / max(1, tot.blocks):.1%})")
    print(f"prefill tokens saved    {saved} of {tot.prompt_tokens} prompt tokens "
          f"({saved / max(1, tot.prompt_tokens):.1%})")
    print(f"bytes read              {format_size(tot.bytes_read)} at "
          f"{tot.bytes_read / max(tot.read_s, 1e-9) / 1e9:.2f} GB/s per instance")
    print(f"bytes written           {format_size(tot.bytes_written)} at "
          f"{tot.bytes_written / max(tot.write_s, 1e-9) / 1e9:.2f} GB/s per instance")
    print(f"master                  {st.objects} objects, {st.hits} hits, {st.misses} misses, "
          f"{st.evictions} evictions")
    print(f"wrong blocks            {tot.wrong_blocks}")
    for e in tot.errors[:5]:
        print(f"error: {e}")
    return 1 if tot.wrong_blocks or tot.errors else 0
