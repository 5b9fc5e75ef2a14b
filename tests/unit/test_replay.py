"""Trace replay: determinism, the reuse accounting, the instance model, the command line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from kvpool.common.errors import InvalidArgument
from kvpool.tools.replay_sim import (
    ALL_POLICIES,
    InstanceModel,
    LRUBlocks,
    PrefixBlocks,
    Request,
    ideal_reuse,
    load_trace,
    simulate,
    ttft_floor_s,
)

TRACE = Path(__file__).parents[1] / "data" / "mooncake_conversation_trace_head.jsonl"


def synthetic_trace(path: Path, n: int = 200) -> Path:
    """Conversations of growing prompts: turn t of conversation c extends turn t-1."""
    lines, next_id = [], 10_000
    convs: dict[int, list[int]] = {}
    for i in range(n):
        c = i % 17
        hist = convs.setdefault(c, [c])           # block 0 of a conversation: its system prompt
        hist.append(next_id)
        next_id += 1
        lines.append(json.dumps({"timestamp": i * 150, "input_length": 512 * len(hist) - 100,
                                 "output_length": 10, "hash_ids": hist}))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_replay_is_deterministic_for_a_seed():
    reqs = load_trace(TRACE)
    for policy in ALL_POLICIES:
        a = simulate(reqs, policy, instances=4, cache_blocks=300, store_blocks=2000, seed=3)
        b = simulate(reqs, policy, instances=4, cache_blocks=300, store_blocks=2000, seed=3)
        assert a == b, policy
    other = simulate(reqs, "random", instances=4, cache_blocks=300, store_blocks=2000, seed=4)
    assert other[1] != simulate(reqs, "random", instances=4, cache_blocks=300,
                                store_blocks=2000, seed=3)[1]


def test_ideal_reuse_counts_prefix_tokens_only():
    reqs = [Request(0, 1024, (1, 2)), Request(1, 1500, (1, 2, 3)), Request(2, 1000, (9, 2))]
    # Second request reuses blocks 1-2 (1024 tokens); the third's block 2 follows a miss.
    assert ideal_reuse(reqs) == pytest.approx(1024 / 3524)


def test_hits_accounting_and_the_instance_model():
    model = InstanceModel(prefill_s_per_token=0.001, store_s_per_token=0.0001, block_tokens=10)
    reqs = [Request(0.0, 30, (1, 2, 3)), Request(10.0, 25, (1, 2, 4)),
            Request(20.0, 25, (1, 2, 4))]
    # One instance: request 2 hits 1-2 locally, request 3 hits all of it.
    res, ttfts = simulate(reqs, "kvpool", instances=1, cache_blocks=100, store_blocks=0,
                          model=model)
    assert res.local_hit == pytest.approx((20 + 25) / 80) and res.store_hit == 0
    assert ttfts == pytest.approx([0.030, 0.005, 0.0])
    # Two instances, round robin, with a store: request 2 lands on the other instance and
    # reads 1-2 from the store; request 3 is back on the first, which holds 1-2 but not 4:
    # 4 comes from the store, where request 2 put it.
    res, ttfts = simulate(reqs, "round_robin", instances=2, cache_blocks=100,
                          store_blocks=100, model=model)
    assert res.store_hit == pytest.approx((20 + 5) / 80) and res.local_hit == pytest.approx(20 / 80)
    assert ttfts == pytest.approx([0.030, 0.002 + 0.005, 0.0005])


def test_fifo_queueing_delays_a_busy_instance():
    model = InstanceModel(prefill_s_per_token=0.01, store_s_per_token=0.001, block_tokens=10)
    reqs = [Request(0.0, 100, tuple(range(10))), Request(0.0, 100, tuple(range(100, 110)))]
    _, ttfts = simulate(reqs, "round_robin", instances=1, cache_blocks=0, store_blocks=0,
                        model=model)
    assert ttfts == pytest.approx([1.0, 2.0])


def test_lru_reports_what_it_stored_and_evicted():
    lru = LRUBlocks(2)
    assert lru.add([1, 2]) == ([1, 2], [])
    lru.touch([1])
    assert lru.add([3]) == ([3], [2])
    assert lru.add([4, 5, 6]) == ([5, 6], [1, 3])   # 4 came and went in the same call


def test_the_store_evicts_chain_tails_first():
    store = PrefixBlocks(3, parent_of={2: 1, 3: 2, 5: 1})
    assert store.add([1, 2, 3]) == ([1, 2, 3], [])
    assert store.add([5]) == ([5], [3])            # plain LRU would drop 1 and strand 2-3
    store.touch([1, 2])
    assert store.add([6]) == ([6], [5]) and 1 in store and 2 in store and len(store) == 3
    with pytest.raises(InvalidArgument, match="store eviction"):
        simulate([Request(0.0, 10, (1,))], "kvpool", store_eviction="fifo")


def test_prefix_eviction_keeps_more_reuse_than_lru_when_the_store_is_tight():
    model = InstanceModel(prefill_s_per_token=0.001, store_s_per_token=0.0001, block_tokens=10)
    # A 3-block prompt, two 1-block ones, the first again; the store holds 4 blocks. The third
    # prompt's put evicts LRU's oldest block, the first prompt's head, which strands the rest;
    # prefix-aware eviction drops that prompt's tail and the repeat reuses 2 blocks.
    reqs = [Request(0.0, 30, (1, 2, 3)), Request(1.0, 10, (7,)), Request(2.0, 10, (8,)),
            Request(3.0, 30, (1, 2, 3))]

    def store_hit(eviction: str) -> float:
        return simulate(reqs, "round_robin", instances=1, cache_blocks=0, store_blocks=4,
                        model=model, store_eviction=eviction)[0].store_hit
    assert store_hit("lru") == 0 and store_hit("prefix") == pytest.approx(20 / 80)


def test_the_ttft_floor_is_the_prefill_of_what_no_earlier_request_computed():
    model = InstanceModel(prefill_s_per_token=0.01, block_tokens=10)
    reqs = [Request(0.0, 20, (1, 2)), Request(0.0, 25, (1, 2, 3)), Request(0.0, 15, (9, 2))]
    assert ttft_floor_s(reqs, model) == pytest.approx([0.2, 0.05, 0.15])
    for policy in ALL_POLICIES:
        _, ttfts = simulate(reqs, policy, instances=2, model=model)
        assert all(t >= f - 1e-12 for t, f in zip(ttfts, ttft_floor_s(reqs, model)))


def test_bad_traces_are_explained(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 10}\n')
    with pytest.raises(InvalidArgument, match="bad.jsonl:1: not a Mooncake trace line"):
        load_trace(bad)
    with pytest.raises(InvalidArgument, match="cannot read trace"):
        load_trace(tmp_path / "missing.jsonl")


def test_cli_writes_json_and_plot(tmp_path):
    trace = synthetic_trace(tmp_path / "trace.jsonl")
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    r = subprocess.run([sys.executable, "-m", "kvpool", "replay", str(trace), "--instances", "3",
                        "--cache-blocks", "20", "--store-blocks", "50", "--json", str(out),
                        "--plot", str(png)], capture_output=True, text=True, check=False, timeout=120)
    assert r.returncode == 0, r.stderr
    report = json.loads(out.read_text())
    assert report["default_policy"] == "kvpool" and 0 < report["ideal_reuse"] < 1
    assert report["config"]["store_writes"] == "prefill"
    assert report["config"]["store_eviction"] == "prefix" and report["ttft_floor_p90_s"] > 0
    assert set(report["policies"]) == set(ALL_POLICIES)
    for res in report["policies"].values():
        assert res["local_hit"] + res["store_hit"] + res["recomputed"] == pytest.approx(1)
        assert {"ttft_mean_s", "ttft_p90_s"} <= set(res)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "kvpool" in r.stdout and "ideal reuse" in r.stdout


@pytest.mark.parametrize("args, message", [
    (["--policies", "best"], "unknown policy 'best'"),
    (["--instances", "0"], "invalid count"),
])
def test_cli_bad_flags_are_explained(tmp_path, args, message):
    r = subprocess.run([sys.executable, "-m", "kvpool", "replay", "t.jsonl", *args],
                       capture_output=True, text=True, check=False, timeout=60)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr


def test_cli_missing_trace_is_a_clean_error(tmp_path):
    r = subprocess.run([sys.executable, "-m", "kvpool", "replay", str(tmp_path / "nope.jsonl")],
                       capture_output=True, text=True, check=False, timeout=60)
    assert r.returncode == 1 and "cannot read trace" in r.stderr and "Traceback" not in r.stderr


def test_eviction_writes_put_only_what_an_instance_evicts():
    model = InstanceModel(prefill_s_per_token=0.001, store_s_per_token=0.0001, block_tokens=10)
    reqs = [Request(0.0, 20, (1, 2)), Request(10.0, 20, (3, 4)), Request(20.0, 20, (1, 2))]
    # One instance with room for 2 blocks: request 2 evicts 1-2 into the store; request 3
    # finds them there, not locally.
    res, _ = simulate(reqs, "kvpool", instances=1, cache_blocks=2, store_blocks=10, model=model,
                      store_writes="eviction")
    assert res.store_hit == pytest.approx(20 / 60) and res.local_hit == 0
    with pytest.raises(InvalidArgument, match="store writes"):
        simulate(reqs, "kvpool", store_writes="sometimes")


def test_a_trace_scaled_for_real_engines_keeps_its_prefix_structure():
    from kvpool.tools.replay_gateway import FIRST_TOKEN, scale
    reqs = [Request(1.0, 1200, (0, 1, 2)), Request(2.0, 1100, (0, 1, 5)), Request(3.0, 300, (7,))]
    scaled, prompts = scale(reqs, trace_block_tokens=512, live_block_tokens=16,
                            vocab_size=1000, time_scale=0.5)
    assert [r.arrival_s for r in scaled] == [0.5, 1.0, 1.5]
    assert [len(p) for p in prompts] == [16 + 16 + 176 * 16 // 512, 16 + 16 + 76 * 16 // 512,
                                         300 * 16 // 512]
    assert prompts[0][:32] == prompts[1][:32] and prompts[0][32:] != prompts[1][32:34]
    assert all(FIRST_TOKEN <= t < 1000 for p in prompts for t in p)
    assert [r.input_tokens for r in scaled] == [len(p) for p in prompts]
    cut, cut_prompts = scale(reqs, trace_block_tokens=512, live_block_tokens=16,
                             vocab_size=1000, time_scale=1.0, max_prompt_tokens=20)
    assert cut_prompts[0] == prompts[0][:20] and cut[0].hash_ids == (0, 1)
    _, other = scale(reqs, trace_block_tokens=512, live_block_tokens=16, vocab_size=1000,
                     time_scale=1.0, salt=1)
    assert other[0][:16] != prompts[0][:16]   # another salt: no shared prefix


def test_a_window_of_the_trace_starts_at_zero_and_the_best_one_has_the_most_reuse():
    from kvpool.tools.replay_gateway import best_window, window
    # Requests 0-2 share nothing; 3-5 extend one conversation (prefix 9, 10, ...).
    reqs = [Request(0.0, 512, (1,)), Request(1.0, 512, (2,)), Request(2.0, 512, (3,)),
            Request(3.0, 1024, (9, 10)), Request(4.0, 1536, (9, 10, 11)),
            Request(5.0, 2048, (9, 10, 11, 12))]
    part = window(reqs, 3, 2)
    assert [r.arrival_s for r in part] == [0.0, 1.0] and part[1].hash_ids == (9, 10, 11)
    start, reuse = best_window(reqs, 3, block_tokens=512)
    assert start == 3 and reuse == pytest.approx((1024 + 1536) / (1024 + 1536 + 2048))
    # Cut to 2 blocks, as the live replay cuts long prompts: every prompt is (9, 10).
    start, reuse = best_window(reqs, 3, block_tokens=512, max_blocks=2)
    assert start == 3 and reuse == pytest.approx(2 / 3)
    with pytest.raises(InvalidArgument, match="--start 6"):
        window(reqs, 6, 2)


def test_multi_turn_keeps_whole_conversations_of_two_turns_or_more():
    from kvpool.tools.replay_gateway import multi_turn
    # Every request starts with block 0 (as in the conversation trace); conversations are
    # told apart by their second block: (0, 5) has three turns, (0, 6) two, (0, 7) one.
    reqs = [Request(10.0, 1024, (0, 5)), Request(11.0, 1024, (0, 7)),
            Request(12.0, 1024, (0, 6)), Request(13.0, 1536, (0, 5, 8)),
            Request(14.0, 1536, (0, 6, 9)), Request(15.0, 2048, (0, 5, 8, 10))]
    got = multi_turn(reqs, 0, 6, 5)
    assert [r.hash_ids[1] for r in got] == [5, 6, 5, 6, 5]
    assert [r.arrival_s for r in got] == [0.0, 2.0, 3.0, 4.0, 5.0]
    # A conversation that does not fit whole is left out, not cut.
    assert [r.hash_ids[1] for r in multi_turn(reqs, 0, 6, 2)] == [6, 6]
    with pytest.raises(InvalidArgument, match="two turns"):
        multi_turn(reqs, 0, 2, 5)


def test_the_engines_and_gateways_counters_are_read_from_their_metrics_pages():
    from kvpool.tools.replay_gateway import by_label, routed_by
    engine = ('# HELP vllm:prefix_cache_hits_total hits\n# TYPE vllm:prefix_cache_hits_total counter\n'
              'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 96.0\n'
              'vllm:prefix_cache_hits_total{engine="1",model_name="m"} 32.0\n')
    assert by_label(engine, "vllm:prefix_cache_hits_total") == {"": 128.0}
    route = ('# TYPE kvpool_gateway_route_seconds histogram\n'
             'kvpool_gateway_route_seconds_count{policy="kvpool"} %d\n'
             'kvpool_gateway_route_seconds_count{policy="fallback_least_loaded"} %d\n')
    assert routed_by(route % (3, 1), route % (19, 1)) == {"kvpool": 16}
