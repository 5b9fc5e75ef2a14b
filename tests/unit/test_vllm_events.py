"""vLLM KV-event decoding and translation to kvpool hashes (sans-IO)."""

from __future__ import annotations

import msgpack
import pytest
from kvpool.client.vllm_events import VLLMEventTranslator, decode_vllm_batch
from kvpool.common.errors import HashSpecMismatch, InvalidArgument
from kvpool.common.hashing import HashSpec
from kvpool.common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

SPEC = HashSpec.of(4, model="m")
TOKENS = list(range(100, 116))        # 4 blocks of 4
OURS = SPEC.hashes(TOKENS)


def stored(hashes, parent, tokens, medium="GPU", **kw):
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
            "token_ids": tokens, "block_size": kw.pop("block_size", 4), "medium": medium, **kw}


def test_decodes_array_and_map_encodings_alike():
    arr = msgpack.packb([1.5, [["BlockStored", [1, 2], None, TOKENS[:8], 4, None, "GPU"],
                               ["BlockRemoved", [2], "GPU"], ["AllBlocksCleared"]], 0])
    mapped = msgpack.packb({"ts": 1.5, "data_parallel_rank": 0, "events": [
        {"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None,
         "token_ids": TOKENS[:8], "block_size": 4, "lora_id": None, "medium": "GPU"},
        {"type": "BlockRemoved", "block_hashes": [2], "medium": "GPU"},
        {"type": "AllBlocksCleared"}]})
    a, m = decode_vllm_batch(arr), decode_vllm_batch(mapped)
    assert a.ts == m.ts == 1.5 and a.data_parallel_rank == 0
    assert [e["type"] for e in a.events] == [e["type"] for e in m.events]
    assert a.events[0]["token_ids"] == m.events[0]["token_ids"] and a.events[1]["medium"] == "GPU"
    with pytest.raises(InvalidArgument, match="msgpack"):
        decode_vllm_batch(b"\xc1")


def test_engine_hashes_become_kvpool_hashes_through_the_chain():
    t = VLLMEventTranslator(SPEC)
    assert t.translate([stored([b"a", b"b"], None, TOKENS[:8])]) == [BlockStored(tuple(OURS[:2]))]
    # A later event continues the chain from an engine parent hash it has seen.
    assert t.translate([stored([7, 8], b"b", TOKENS[8:16], medium="CPU")]) == \
        [BlockStored(tuple(OURS[2:4]), "cpu")]
    assert t.translate([{"type": "BlockRemoved", "block_hashes": [b"b", b"zz"], "medium": None}]) \
        == [BlockRemoved((OURS[1],), "gpu")]
    assert t.translate([{"type": "AllBlocksCleared"}]) == [AllBlocksCleared()]
    # After the clear, a child of a forgotten parent cannot be placed: skipped, counted.
    assert t.translate([stored([9], 8, TOKENS[:4])]) == [] and t.skipped_blocks == 1


def test_lora_blocks_hash_in_their_own_namespace():
    t = VLLMEventTranslator(SPEC)
    (ev,) = t.translate([stored([1], None, TOKENS[:4], lora_name="sql")])
    assert ev.hashes[0] != OURS[0]
    assert ev.hashes[0] == HashSpec.of(4, model="m", lora="sql").hashes(TOKENS[:4])[0]


def test_an_engine_with_another_block_size_is_refused():
    with pytest.raises(HashSpecMismatch, match="16-token blocks.*--block-size to 4"):
        VLLMEventTranslator(SPEC).translate([stored([1], None, TOKENS, block_size=16)])
    with pytest.raises(InvalidArgument, match="carries 3 token ids"):
        VLLMEventTranslator(SPEC).translate([stored([1], None, TOKENS[:3])])
