"""The token-block layer: a prompt's KV blocks by chained hash (kvpool-sha256-v1).

    spec = HashSpec.of(16, model="llama-3-8b")
    with KVClient(master) as kv:
        blocks = TokenBlocks(kv, spec)            # registers the spec with the master
        n = blocks.cached_prefix(prompt)          # full blocks already in the pool
        blocks.get_prefix(prompt, out_bufs[:n])   # their KV into your buffers
        blocks.put(prompt, kv_bufs)               # store the KV of the prompt's full blocks

Each call is one batched round trip to the master plus the data transfers (a read that outlives
its lease adds one version check). Only full blocks are hashed; a trailing partial block's KV is
never stored.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvpool.client.kv_client import KVClient
from kvpool.client.router import RouterClient
from kvpool.common.errors import AlreadyExists, InvalidArgument, KVPoolError
from kvpool.common.hashing import HashSpec, block_key


class TokenBlocks:
    """Prompt-level put / longest cached prefix / read over a KVClient."""

    def __init__(self, kv: KVClient, spec: HashSpec, *, register: bool = True,
                 client_id: str = ""):
        """``register``: check the block size and hash spec with the master first (raises
        HashSpecMismatch if the cluster uses another)."""
        self.kv = kv
        self.spec = spec
        self._root = spec.root()
        if register:
            with RouterClient(kv.master_address) as router:
                router.register(spec, client_id=client_id)

    def keys(self, tokens: Sequence[int]) -> list[str]:
        """Store keys of the full blocks of ``tokens``."""
        return [block_key(h) for h in self.spec.hashes(tokens)]

    def put(self, tokens: Sequence[int], blocks: Sequence) -> list[KVPoolError | None]:
        """Store ``blocks[i]`` (the KV of full block i) for the first ``len(blocks)`` full
        blocks of ``tokens``. Blocks already stored are left alone and reported as None: another
        instance computed the same KV. Per block: None or the error (NoSpace, ...).

        Block i names block i - 1 as its parent, so the master's prefix-aware eviction drops
        a prompt's blocks from the tail and keeps prefixes shared by many prompts longest."""
        keys = self.keys(tokens)
        if len(blocks) > len(keys):
            raise InvalidArgument(f"{len(blocks)} KV blocks for a prompt of {len(keys)} full "
                                  f"blocks of {self.spec.block_size} tokens")
        keys = keys[:len(blocks)]
        results = self.kv.batch_put(keys, blocks, parents=[None, *keys[:-1]] if keys else None)
        return [None if isinstance(r, AlreadyExists) else r for r in results]

    def cached_prefix(self, tokens: Sequence[int]) -> int:
        """How many leading full blocks of ``tokens`` the pool holds (one master round trip)."""
        keys = self.keys(tokens)
        if not keys:
            return 0
        found = self.kv.batch_exists(keys)
        return next((i for i, f in enumerate(found) if not f), len(keys))

    def get_prefix(self, tokens: Sequence[int], buffers: Sequence, *, first: int = 0) -> int:
        """Read the KV of full blocks ``first, first + 1, ...`` (one per buffer) into
        ``buffers``; return how many leading blocks were read (a block is usable only if every
        earlier one is: counting stops at the first missing or failed block). ``first`` skips
        blocks the caller already holds, e.g. in its own GPU cache."""
        keys = self.keys(tokens)
        if first < 0 or first + len(buffers) > len(keys):
            raise InvalidArgument(f"blocks {first}..{first + len(buffers) - 1} of a prompt of "
                                  f"{len(keys)} full blocks of {self.spec.block_size} tokens")
        if not buffers:
            return 0
        got = self.kv.batch_get_into(keys[first:first + len(buffers)], buffers)
        return next((i for i, r in enumerate(got) if isinstance(r, KVPoolError)), len(got))
