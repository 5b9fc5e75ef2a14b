"""The store keys of vLLM's KV blocks (scheme ``kvpool-vllm-v1``), and prefix matching over them.

vLLM names each full block of a request by a chained SHA-256 (``request.block_hashes``): block
*i*'s hash covers every token before it, plus what vLLM knows changes the KV of the same tokens
(LoRA adapter, multimodal inputs, cache salt). With the default ``sha256`` algorithm the chain's
seed is fixed, so the same prompt gets the same hashes in every vLLM process (a non-cryptographic
algorithm without a shared ``PYTHONHASHSEED`` seeds per process: such engines simply never match).
A vLLM block hash does not cover what else makes its bytes differ, so the key adds it::

    namespace = SHA-256( "kvpool-vllm-v1\\0" || JSON{model, kv dtype, block_size, tp_size,
                                                   hash_algo} )[:16 bytes] as hex
    key       = "kvpool/vllm1/" namespace "/" block_hash.hex() "/" layer_name "/" tp_rank

One object per (block, attention layer, tensor-parallel rank): the bytes of that layer's paged
KV block exactly as the engine holds it (on CPU ``(kv_heads, block_size, 2 * head_dim)``,
K and V packed), so a load writes straight into the paged cache. Because block hashes chain, a
block is only ever matched as part of its prefix: :func:`present_prefix` counts the leading
blocks *all* of whose objects are stored and stops at the first block missing any.

These keys are not kvpool's own token-block keys (``common/hashing.py``, ``kvpool/b1/...``):
those hash token ids only and name one value per block; the router's KV-event bridge
(``kvpool kv-events``) translates vLLM's events into that spec for cache-aware routing.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass

SCHEME = "kvpool-vllm-v1"
KEY_PREFIX = "kvpool/vllm1/"


@dataclass(frozen=True, slots=True)
class VLLMKeyScheme:
    """What makes one engine's KV bytes differ from another's for the same block hash."""

    model: str
    kv_dtype: str
    block_size: int
    tp_size: int
    hash_algo: str
    layer_names: tuple[str, ...]

    @property
    def namespace(self) -> str:
        identity = json.dumps({"model": self.model, "kv_dtype": self.kv_dtype,
                               "block_size": self.block_size, "tp_size": self.tp_size,
                               "hash_algo": self.hash_algo}, sort_keys=True)
        return hashlib.sha256(f"{SCHEME}\0{identity}".encode()).hexdigest()[:32]

    def block_keys(self, block_hash: bytes, tp_rank: int) -> list[str]:
        """One key per layer (in ``layer_names`` order) for a block on one TP rank."""
        base = f"{KEY_PREFIX}{self.namespace}/{block_hash.hex()}/"
        return [f"{base}{layer}/{tp_rank}" for layer in self.layer_names]

    def prefix_keys(self, block_hashes: Sequence[bytes]) -> list[str]:
        """Every object of every block, block by block (all layers, all TP ranks): what must
        all be stored for the blocks to load on every rank."""
        return [k for h in block_hashes for r in range(self.tp_size) for k in self.block_keys(h, r)]

    @property
    def objects_per_block(self) -> int:
        return len(self.layer_names) * self.tp_size


def present_prefix(found: Sequence[bool], objects_per_block: int) -> int:
    """How many leading blocks have all their objects present (``found`` is block-major, as
    :meth:`VLLMKeyScheme.prefix_keys` orders it)."""
    n = 0
    for start in range(0, len(found) - objects_per_block + 1, objects_per_block):
        if not all(found[start:start + objects_per_block]):
            break
        n += 1
    return n


def loadable_blocks(num_tokens: int, num_hashes: int, block_size: int) -> int:
    """The most leading full blocks a request may take from the store: every full block whose
    hash vLLM has, but never the request's last token, which vLLM must compute itself to
    produce the next token's logits."""
    return max(0, min(num_hashes, (num_tokens - 1) // block_size))
