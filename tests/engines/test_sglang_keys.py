"""The SGLang key scheme (client/connectors/sglang_keys.py): engine-free, no sglang needed."""

from dataclasses import replace

from kvpool.client.connectors.sglang_keys import KEY_PREFIX, SGLangKeyScheme, present_pages

MHA = SGLangKeyScheme(model="m", dtype="bfloat16", page_size=16, layout="page_first",
                      part_bytes=(1536, 1536), tp_rank=0, tp_size=2)


def test_the_namespace_is_a_published_function_of_the_identity():
    # Pinned: a change here strands every page stored under the old namespace.
    assert MHA.namespace == "5d6c18c90e80fdadd29bf1226eca1404"
    assert MHA.keys(["ab"]) == [f"{KEY_PREFIX}{MHA.namespace}/ab/0",
                                f"{KEY_PREFIX}{MHA.namespace}/ab/1"]


def test_everything_that_changes_a_pages_bytes_changes_the_namespace():
    changed = [replace(MHA, model="n"), replace(MHA, dtype="float16"),
               replace(MHA, page_size=32), replace(MHA, layout="page_first_direct"),
               replace(MHA, part_bytes=(3072,)), replace(MHA, tp_rank=1),
               replace(MHA, tp_size=4), replace(MHA, pp_rank=1, pp_size=2),
               replace(MHA, cp_rank=1, cp_size=2)]
    assert len({s.namespace for s in changed} | {MHA.namespace}) == len(changed) + 1


def test_parents_chain_each_part_to_the_same_part_of_the_page_before():
    keys = MHA.keys(["a", "b"])
    assert MHA.parents(["a", "b"], None) == [None, None, keys[0], keys[1]]
    assert MHA.parents(["b"], "a") == keys[:2]


def test_present_pages_counts_leading_pages_with_every_part():
    assert present_pages([True, True, True, False, True, True], 2) == 1
    assert present_pages([True, True, True, True], 2) == 2
    assert present_pages([False, True], 1) == 0
    assert present_pages([], 2) == 0
