"""shm-specific behaviour: who can reach a node, and hand-off failures."""

from __future__ import annotations

from dataclasses import replace

from kvpool.client.transport.base import IoOp
from kvpool.client.transport.shm import SHMTransport
from kvpool.common.errors import SegmentBoundsError, TransportError
from kvpool.common.host import local_boot_id
from kvpool.common.types import Extent, Replica


def test_cannot_reach_a_node_on_another_boot_id(node):
    transport = SHMTransport()
    assert transport.can_reach(node.node)
    assert not transport.can_reach(replace(node.node, boot_id="another-host"))
    assert not transport.can_reach(replace(node.node, shm_endpoint=""))
    assert not SHMTransport(boot_id="").can_reach(replace(node.node, boot_id=""))
    assert SHMTransport(boot_id="b").can_reach(replace(node.node, boot_id="b"))


def test_local_boot_id_is_stable_and_looks_like_a_uuid():
    assert local_boot_id() == local_boot_id()
    assert len(local_boot_id()) == 36 and local_boot_id().count("-") == 4


def test_refused_handoff_fails_fast_with_transport_error(node):
    transport = SHMTransport(retry_after_s=60)
    elsewhere = replace(node.node, shm_endpoint="kvpool-other-netns")   # nobody listens there
    op = IoOp(Replica(elsewhere, Extent(node.segments[0].segment_id, 0, 4)),
              memoryview(bytearray(4)))
    for _ in range(2):   # the second time from the refusal cache
        (result,) = transport.read([op])
        assert isinstance(result, TransportError) and not isinstance(result, SegmentBoundsError)
    transport.close()


def test_mapping_is_shared_with_the_node(node):
    """A write through one client's mapping is visible through another client's."""
    a, b = SHMTransport(), SHMTransport()
    try:
        replica = node.replica(1, 777, 6)
        assert a.write([IoOp(replica, memoryview(b"shared"))]) == [None]
        out = bytearray(6)
        assert b.read([IoOp(replica, memoryview(out))]) == [None]
        assert out == b"shared"
    finally:
        a.close()
        b.close()
