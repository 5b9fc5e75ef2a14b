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
    # A malformed event is skipped (and counted), not fatal: the bridge goes on.
    t = VLLMEventTranslator(SPEC)
    assert t.translate([stored([1], None, TOKENS[:3])]) == [] and t.malformed_events == 1


@pytest.mark.parametrize("batch", [
    [b"not a time", [], 0],                                  # a string timestamp
    {"ts": "soon", "events": []},
    [1.0, 7, 0],                                             # events not a list
    [1.0, [[{"a": 1}, [1]]], 0],                             # an unhashable tag
    [1.0, [42], 0],                                          # an event that is no struct
])
def test_a_batch_of_the_wrong_shape_is_invalid_argument(batch):
    with pytest.raises(InvalidArgument):
        decode_vllm_batch(msgpack.packb(batch))


@pytest.mark.parametrize("event", [
    ["BlockStored", [{"h": 1}], None, TOKENS[:4], 4, None, "GPU"],   # a map as a hash
    ["BlockStored", [1]],                                             # too few fields
    ["BlockStored", [1], None, ["a", "b", "c", "d"], 4, None, "GPU"],  # str token ids
    ["BlockStored", [1], None, TOKENS[:4], "4", None, "GPU"],         # str block size
    ["BlockStored", [1], {"p": 1}, TOKENS[:4], 4, None, "GPU"],       # a map as the parent
    ["BlockRemoved", [{"h": 1}], None],
    ["BlockRemoved", 5, None],
    ["Teleported", [1]],                                              # an unknown tag
])
def test_a_malformed_event_is_skipped_alone(event):
    t = VLLMEventTranslator(SPEC)
    good = {"type": "BlockStored", "block_hashes": [9], "parent_block_hash": None,
            "token_ids": TOKENS[:4], "block_size": 4, "medium": "GPU"}
    [bad] = decode_vllm_batch(msgpack.packb([1.0, [event], 0])).events
    out = t.translate([bad, good])
    assert t.malformed_events == 1
    assert [type(e) for e in out] == [BlockStored]
