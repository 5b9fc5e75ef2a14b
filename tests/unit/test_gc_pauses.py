"""The master's collection pauses as Prometheus reads them (master/metrics.py GcPauses)."""

from __future__ import annotations

import gc

from kvpool.master.metrics import GC_BUCKETS_S, GcPauses
from prometheus_client import CollectorRegistry, generate_latest


def test_each_collection_is_timed_by_generation_and_the_callback_goes_at_close():
    pauses = GcPauses()
    try:
        registry = CollectorRegistry()
        registry.register(pauses)
        gc.collect(0)
        gc.collect(2)
        gc.collect(2)
        samples = {(s.name, s.labels.get("generation"), s.labels.get("le")): s.value
                   for family in registry.collect() for s in family.samples}
        assert samples["kvpool_master_gc_pause_seconds_count", "2", None] >= 2
        assert samples["kvpool_master_gc_pause_seconds_count", "0", None] >= 1
        assert samples["kvpool_master_gc_pause_seconds_sum", "2", None] > 0
        # Buckets are cumulative, up to +Inf = the count.
        buckets = [samples["kvpool_master_gc_pause_seconds_bucket", "2", le]
                   for le in [*map(str, GC_BUCKETS_S), "+Inf"]]
        assert buckets == sorted(buckets)
        assert buckets[-1] == samples["kvpool_master_gc_pause_seconds_count", "2", None]
        assert samples["kvpool_master_gc_frozen_objects", None, None] == gc.get_freeze_count()
        assert b"kvpool_master_gc_pause_seconds_bucket" in generate_latest(registry)
    finally:
        pauses.close()
    assert pauses._timed not in gc.callbacks
    before = sum(pauses._counts[2])
    gc.collect(2)
    assert sum(pauses._counts[2]) == before
