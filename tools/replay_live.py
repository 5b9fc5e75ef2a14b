"""``kvpool replay --live``: the first requests of a trace against a running cluster, with real
block bytes, routed by the master's Router, every byte read back verified.

Each trace block becomes ``--live-block-tokens`` synthetic tokens derived from its hash id (so
two requests sharing a prefix of hash ids share the tokens, hence kvpool's chained hashes); a
partial last trace block becomes a partial live block, which is never stored. A block's bytes
are its kvpool hash repeated to ``--block-bytes``, so any byte read back can be checked.

Per request, in trace order: route it (token ids; candidates = the simulated instances with
the load the replay's instance model gives them at the request's trace time, so the default
policy spreads load as it would in the simulation), take the chosen instance's own
cached prefix as local hits, read the blocks after it that the store holds into buffers and
verify them, put the prompt's blocks (ones already stored are no-ops), update the instance's
LRU cache and publish its BlockStored / BlockRemoved events to the master.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from kvpool.client import KVClient
from kvpool.client.blocks import TokenBlocks
from kvpool.client.router import Candidate, RouterClient
from kvpool.common.errors import InvalidArgument
from kvpool.common.hashing import HashSpec
from kvpool.common.kv_events import BlockRemoved, BlockStored
from kvpool.master.routing import DEFAULT_POLICY
from kvpool.tools.replay_sim import LRUBlocks, Request, load_trace

MODEL_KEY = {"model": "kvpool-replay"}


def live_blocks(req: Request, trace_block_tokens: int, live_block_tokens: int
                ) -> list[tuple[int, int]]:
    """(hash id, live tokens) per trace block: a full trace block is a full live block, a
    partial last one a partial one."""
    out, left = [], req.input_tokens
    for h in req.hash_ids:
        size = min(trace_block_tokens, left)
        left -= size
        out.append((h, live_block_tokens if size == trace_block_tokens else
                    max(1, size * live_block_tokens // trace_block_tokens)))
    return out


def synthetic_tokens(req: Request, trace_block_tokens: int, live_block_tokens: int) -> list[int]:
    """Deterministic tokens per trace block: same hash id, same tokens."""
    return [(h * 1_000_003 + k * 7919) % 2**31
            for h, n in live_blocks(req, trace_block_tokens, live_block_tokens)
            for k in range(n)]


def block_bytes(h: bytes, nbytes: int) -> np.ndarray:
    return np.frombuffer((h * (nbytes // len(h) + 1))[:nbytes], dtype=np.uint8)


def run_live(args) -> int:
    if not args.master:
        raise InvalidArgument("--live needs --master HOST:PORT (a running cluster: kvpool up)")
    requests = load_trace(args.trace, args.requests)
    policy = args.policies[0] if len(args.policies) == 1 else DEFAULT_POLICY
    spec = HashSpec(args.live_block_tokens, tuple(MODEL_KEY.items()))
    instances = {f"i{k}": LRUBlocks(args.cache_blocks) for k in range(args.instances)}
    free_at_s = dict.fromkeys(instances, 0.0)      # the instance model's FIFO, in trace time
    prefill_s = 1 / args.prefill_tokens_per_s
    scale = args.block_tokens / args.live_block_tokens   # live tokens -> trace tokens
    totals = dict.fromkeys(("requests", "blocks", "local_hit_blocks", "store_hit_blocks",
                            "expected_store_blocks", "put_blocks", "bytes_verified",
                            "mismatches", "put_errors"), 0)
    with KVClient(args.master) as kv, RouterClient(args.master) as router:
        blocks = TokenBlocks(kv, spec, client_id="kvpool-replay-live")
        for name in instances:
            router.publish(name, [])
        for n, req in enumerate(requests, 1):
            tokens = synthetic_tokens(req, args.block_tokens, args.live_block_tokens)
            hashes = spec.hashes(tokens)
            loads = [Candidate(i, 0, round(max(0.0, free_at_s[i] - req.arrival_s)
                                           / prefill_s / scale)) for i in instances]
            choice = router.route(token_ids=tokens, extra_keys=MODEL_KEY, policy=policy,
                                  candidates=loads)
            cache = instances[choice.instance_id]
            local = next((j for j, h in enumerate(hashes) if h not in cache), len(hashes))
            expected = choice.hits.get("gpu", 0) + choice.hits.get("store", 0)
            store_n = max(0, expected - local)
            bufs = [np.zeros(args.block_bytes, np.uint8) for _ in range(store_n)]
            got = blocks.get_prefix(tokens, bufs, first=local) if store_n else 0
            for j in range(got):
                if not np.array_equal(bufs[j], block_bytes(hashes[local + j], args.block_bytes)):
                    totals["mismatches"] += 1
                totals["bytes_verified"] += args.block_bytes
            results = blocks.put(tokens, [block_bytes(h, args.block_bytes) for h in hashes])
            totals["put_errors"] += sum(r is not None for r in results)
            stored, evicted = cache.add(hashes)
            events = ([BlockStored(tuple(stored))] if stored else []) \
                + ([BlockRemoved(tuple(evicted))] if evicted else [])
            router.publish(choice.instance_id, events)
            recomputed = req.input_tokens - (local + got) * args.block_tokens
            free_at_s[choice.instance_id] = max(req.arrival_s, free_at_s[choice.instance_id]) \
                + max(0, recomputed) * prefill_s + got * args.block_tokens / args.store_tokens_per_s
            totals["requests"] = n
            totals["blocks"] += len(hashes)
            totals["local_hit_blocks"] += local
            totals["store_hit_blocks"] += got
            totals["expected_store_blocks"] += store_n
            totals["put_blocks"] += len(hashes) - local - got
    ok = totals["mismatches"] == 0
    print(f"live replay of {totals['requests']} requests against {args.master} "
          f"(policy {policy}, {args.instances} instances, {args.live_block_tokens}-token blocks "
          f"of {args.block_bytes} bytes):")
    print(f"  {totals['blocks']} blocks: {totals['local_hit_blocks']} local hits, "
          f"{totals['store_hit_blocks']} read from the store "
          f"(router expected {totals['expected_store_blocks']}), rest computed and put")
    print(f"  {totals['bytes_verified']:,} bytes read back and verified, "
          f"{totals['mismatches']} mismatches, {totals['put_errors']} put errors")
    if args.json:
        Path(args.json).write_text(json.dumps({"live": totals, "policy": policy}, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0 if ok else 1
