"""The scrubber over a real (memfd) segment: intact objects pass, a damaged one is reported
once and forgotten."""

from __future__ import annotations

import os
import threading
import time

import pytest
import structlog
from kvpool.common.checksum import checksum
from kvpool.common.errors import MasterUnavailable
from kvpool.common.loops import Supervisor
from kvpool.common.types import ObjectRecord
from kvpool.store_node.manifest import Manifest
from kvpool.store_node.memory import create_dram_segment
from kvpool.store_node.scrubber import Scrubber


def test_scrubber_reports_damaged_objects_only():
    seg = create_dram_segment("n1", 0, 1 << 20)
    try:
        sid = seg.info.segment_id
        manifest = Manifest()
        records = []
        for i in range(4):
            data = os.urandom(4096)
            seg.buffer[i * 4096:(i + 1) * 4096] = data
            records.append(ObjectRecord(f"k{i}", sid, i * 4096, 4096, checksum(data), i + 1))
        manifest.apply(records, [])
        seg.buffer[2 * 4096 + 100] ^= 0xFF            # one flipped byte in k2
        reported = []
        scrubber = Scrubber(manifest, {sid: seg}, reported.extend, bytes_per_s=1 << 30)
        assert [r.key for r in scrubber.scrub_once()] == ["k2"]
        assert [r.key for r in reported] == ["k2"]
        assert [r.key for r in manifest.records()] == ["k0", "k1", "k3"]
        assert scrubber.scrub_once() == []            # reported once
    finally:
        seg.close()


def test_scrubber_ignores_objects_replaced_during_its_pass():
    """A pass walks a snapshot: an object evicted meanwhile, its space already holding another
    object's bytes, is not corruption and is not reported."""
    seg = create_dram_segment("n1", 0, 1 << 20)
    try:
        sid = seg.info.segment_id
        manifest = Manifest()
        first, second = os.urandom(64 << 10), os.urandom(4096)
        seg.buffer[:len(first)] = first
        seg.buffer[len(first):len(first) + 4096] = second
        victim = ObjectRecord("victim", sid, len(first), 4096, checksum(second), 2)
        manifest.apply([ObjectRecord("first", sid, 0, len(first), checksum(first), 1), victim],
                       [])
        reported = []
        # 64 KiB at 128 KiB/s: the pass rests 0.5 s after the first object.
        scrubber = Scrubber(manifest, {sid: seg}, reported.extend, bytes_per_s=128 << 10)
        result = []
        t = threading.Thread(target=lambda: result.append(scrubber.scrub_once()))
        t.start()
        deadline = time.monotonic() + 5.0
        while scrubber.objects_checked < 1 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert scrubber.objects_checked == 1
        # As the master does: the node applies the removal, then the space is written again.
        manifest.apply([], [("victim", 2)])
        seg.buffer[len(first):len(first) + 4096] = os.urandom(4096)
        t.join(10.0)
        assert result == [[]] and reported == []
        assert scrubber.objects_checked == 2
    finally:
        seg.close()



@pytest.mark.parametrize("error", [RuntimeError("injected"), MasterUnavailable("away")])
def test_a_failed_pass_is_retried_and_only_a_bug_is_a_crash(error):
    """A report that fails (the master away: expected; anything else: a bug, logged once with
    its traceback by the supervisor) is made again by a later pass."""
    seg = create_dram_segment("n1", 0, 1 << 20)
    try:
        sid = seg.info.segment_id
        data = os.urandom(4096)
        seg.buffer[:4096] = bytes(4096)           # not what the checksum says
        manifest = Manifest()
        manifest.apply([ObjectRecord("bad", sid, 0, 4096, checksum(data), 1)], [])
        reports = []
        done = threading.Event()

        def report(records):
            reports.append([r.key for r in records])
            if len(reports) == 1:
                raise error
            done.set()

        fatal = []
        scrubber = Scrubber(manifest, {sid: seg}, report, bytes_per_s=1 << 30,
                            pass_interval_s=0.01, supervisor=Supervisor(fatal.append))
        with structlog.testing.capture_logs() as logs:
            scrubber.start()
            try:
                assert done.wait(10)
            finally:
                scrubber.stop()
        assert reports == [["bad"], ["bad"]] and manifest.get("bad") is None
        crashes = [e for e in logs if e["event"] == "loop_crashed"]
        failures = [e for e in logs if e["event"] == "scrub_report_failed"]
        if isinstance(error, MasterUnavailable):
            assert not crashes and [f["error"] for f in failures] == ["away"]
        else:
            assert [(c["loop"], c["exc_info"]) for c in crashes] == [("scrubber", error)]
            assert not failures
        assert not fatal
    finally:
        seg.close()
