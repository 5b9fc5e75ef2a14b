"""The vLLM connector's key scheme and prefix rules (pure: no vLLM needed)."""

from __future__ import annotations

import hashlib

from kvpool.client.connectors.vllm_keys import (
    KEY_PREFIX,
    VLLMKeyScheme,
    loadable_blocks,
    present_prefix,
)
from kvpool.common.types import validate_key

LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")


def scheme(**kw) -> VLLMKeyScheme:
    args = {"model": "tiny", "kv_dtype": "float32", "block_size": 32, "tp_size": 1,
            "hash_algo": "sha256", "layer_names": LAYERS}
    return VLLMKeyScheme(**{**args, **kw})


def h(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


def test_key_layout_is_the_documented_one():
    s = scheme()
    ns = hashlib.sha256(b'kvpool-vllm-v1\0{"block_size": 32, "hash_algo": "sha256", '
                        b'"kv_dtype": "float32", "model": "tiny", "tp_size": 1}').hexdigest()[:32]
    assert s.namespace == ns
    assert s.block_keys(h(0), 0) == [f"{KEY_PREFIX}{ns}/{h(0).hex()}/{layer}/0"
                                     for layer in LAYERS]
    for key in s.block_keys(h(0), 3):
        validate_key(key)


def test_whatever_changes_the_kv_changes_the_namespace():
    base = scheme().namespace
    for change in ({"model": "other"}, {"kv_dtype": "bfloat16"}, {"block_size": 64},
                   {"tp_size": 2}, {"hash_algo": "xxhash"}):
        assert scheme(**change).namespace != base, change
    # Layer names are in the key itself, not the namespace.
    assert scheme(layer_names=LAYERS[:1]).namespace == base


def test_prefix_keys_are_block_major_over_every_rank_and_layer():
    s = scheme(tp_size=2)
    keys = s.prefix_keys([h(0), h(1)])
    assert s.objects_per_block == 4 and len(keys) == 8
    assert keys[:4] == s.block_keys(h(0), 0) + s.block_keys(h(0), 1)
    assert keys[4:] == s.block_keys(h(1), 0) + s.block_keys(h(1), 1)


def test_a_block_counts_only_with_all_its_objects_and_all_before_it():
    assert present_prefix([], 2) == 0
    assert present_prefix([True] * 6, 2) == 3
    assert present_prefix([True, True, True, False, True, True], 2) == 1   # one layer missing
    assert present_prefix([False, False, True, True], 2) == 0               # no prefix, no hit


def test_the_last_token_is_always_left_to_the_engine():
    assert loadable_blocks(num_tokens=64, num_hashes=2, block_size=32) == 1
    assert loadable_blocks(num_tokens=65, num_hashes=2, block_size=32) == 2
    assert loadable_blocks(num_tokens=200, num_hashes=3, block_size=32) == 3   # hashes known
    assert loadable_blocks(num_tokens=1, num_hashes=0, block_size=32) == 0


def test_version_2_is_one_object_per_block_and_rank_and_never_a_version_1_key():
    s1, s2 = scheme(), scheme(version=2)
    ns = hashlib.sha256(b'kvpool-vllm-v2\0{"block_size": 32, "hash_algo": "sha256", '
                        b'"kv_dtype": "float32", "layers": ["model.layers.0.self_attn.attn", '
                        b'"model.layers.1.self_attn.attn"], "model": "tiny", '
                        b'"tp_size": 1}').hexdigest()[:32]
    assert s2.namespace == ns
    assert s2.block_keys(h(0), 1) == [f"kvpool/vllm2/{ns}/{h(0).hex()}/1"]
    assert s2.objects_per_block == 1 and scheme(version=2, tp_size=4).objects_per_block == 4
    assert not set(s1.prefix_keys([h(0), h(1)])) & set(s2.prefix_keys([h(0), h(1)]))
    # The layers fix each one's offset in the object: other layers, another namespace.
    assert scheme(version=2, layer_names=LAYERS[:1]).namespace != ns
    # 32 layers x 256 blocks: 8,192 objects a request in version 1, 256 in version 2.
    many = tuple(f"model.layers.{i}.self_attn.attn" for i in range(32))
    blocks = [h(i) for i in range(256)]
    assert len(scheme(layer_names=many).prefix_keys(blocks)) == 8192
    assert len(scheme(layer_names=many, version=2).prefix_keys(blocks)) == 256
