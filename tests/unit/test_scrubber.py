"""The scrubber over a real (memfd) segment: intact objects pass, a damaged one is reported
once and forgotten."""

from __future__ import annotations

import os

from kvpool.common.checksum import checksum
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
