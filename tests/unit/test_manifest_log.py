"""ManifestLog on its own: typed events split into a delta, put back in front, and the count
of events recorded, which only appending moves."""

from __future__ import annotations

from kvpool.common.types import ObjectRecord, Reservation
from kvpool.master.manifest_log import ManifestLog, Removal


def test_a_delta_holds_each_kind_of_event_in_order_and_goes_back_in_front():
    log = ManifestLog()
    q = log.keep("n1")
    assert log.keep("n1") is q and log.queue("n2") is None and log.take("n2") is None
    a, b = ObjectRecord("a", "s", 0, 1, None, 1), ObjectRecord("b", "s", 64, 1, None, 2)
    r = Reservation("", "s", 128, 1, 9.0)
    q += [a, Removal("a", 1), r, b]
    assert log.nodes_with_changes() == ["n1"]
    delta = log.take("n1")
    assert (delta.committed, delta.removed, delta.reserved) == ([a, b], [("a", 1)], [r])
    assert log.nodes_with_changes() == [] and q == []   # emptied in place
    q.append(Removal("b", 2))
    log.requeue("n1", delta)
    again = log.take("n1")
    assert again.committed == [a, b] and again.removed == [("a", 1), ("b", 2)]


def test_only_appending_moves_the_count_of_events_recorded():
    log = ManifestLog()
    q = log.keep("n1")
    mark = log.recorded
    q.append(Removal("a", 1))
    assert log.recorded == mark + 1
    mark = log.recorded
    delta = log.take("n1")
    log.requeue("n1", delta)
    log.take("n1")
    log.keep("n2").append(Removal("b", 1))
    log.forget("n2")
    assert log.recorded == mark + 1   # n2's one append; taking, putting back, dropping: none


def test_has_removals_sees_each_queued_removal_until_it_is_taken():
    """A fenced put asks on every call whether a removal is still queued (it must not be
    answered before one is applied); the answer follows appends, takes and requeues."""
    log = ManifestLog()
    q = log.keep("n1")
    q.append(ObjectRecord("a", "s", 0, 64, None, 1))
    assert not log.has_removals()
    q.append(Removal("a", 1))
    q.append(ObjectRecord("b", "s", 64, 64, None, 2))
    assert log.has_removals() and log.has_removals()
    delta = log.take("n1")
    assert not log.has_removals()
    q.append(ObjectRecord("c", "s", 128, 64, None, 3))
    q.append(ObjectRecord("d", "s", 192, 64, None, 4))
    q.append(ObjectRecord("e", "s", 256, 64, None, 5))
    assert not log.has_removals()
    log.requeue("n1", delta)   # the stream broke: the removal is queued again, in front
    assert log.has_removals()
    log.take("n1")
    log.keep("n2").append(Removal("x", 9))
    assert log.has_removals()
