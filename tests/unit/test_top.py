from kvpool.protos.kvpool.v1 import master_pb2 as pb
from kvpool.tools.top_cmd import render


def _stats(hits: int, misses: int, hit_bytes: int, committed: int) -> pb.StatsResponse:
    seg = pb.SegmentStats(node_id="n0", used_bytes=1 << 20, objects=committed,
                          segment=pb.SegmentInfo(segment_id="n0/0", size_bytes=4 << 20))
    return pb.StatsResponse(segments=[seg], objects=committed, hits=hits, misses=misses,
                            hit_bytes=hit_bytes, committed=committed,
                            committed_bytes=committed * 1000, nodes=1)


def test_the_first_view_has_no_rates_and_the_next_ones_rate_over_the_interval():
    first = render("m:1", (10.0, _stats(100, 100, 0, 5)), None)
    assert "hit rate - now, 50.0% overall" in first and "gets - (-)" in first
    view = render("m:1", (12.0, _stats(130, 110, 4 << 20, 25)), (10.0, _stats(100, 100, 0, 5)))
    assert "hit rate 75.0% now, 54.2% overall" in view      # 30 of 40 in the interval
    assert "gets 15 keys/s (2.0 MiB/s), misses 5 keys/s, puts 10 keys/s (9.8 KiB/s)" in view
    assert "n0" in view and "1.0 MiB" in view and "25.0%" in view
