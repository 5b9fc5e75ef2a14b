"""Engines found through the master's instances (gateway/discovery.py ``reconcile``), and what
the routing index tells of its instances (``announce``, ``describe``): pure, on a fake clock."""

from __future__ import annotations

import pytest
from kvpool.client.router import InstanceInfo
from kvpool.common.errors import InvalidArgument
from kvpool.gateway.discovery import reconcile
from kvpool.gateway.engines import EnginePool, EngineSpec
from kvpool.master.routing import RoutingIndex


def info(instance_id: str, url: str = "", role: str = "both") -> InstanceInfo:
    return InstanceInfo(instance_id, url, role, 0, 0, 0.0)


def test_instances_with_a_url_become_engines_down_until_probed(clock):
    pool = EnginePool([EngineSpec("static", "http://h:1")], clock=clock)
    found: set[str] = set()
    changes = reconcile(pool, [info("p", "http://h:2", "prefill"), info("silent"),
                               info("d", "h:3", "decode")], found)
    assert [(s.instance_id, s.url, s.role) for s in changes.added] == [
        ("p", "http://h:2", "prefill"), ("d", "http://h:3", "decode")]
    assert found == {"p", "d"} and set(pool.engines) == {"static", "p", "d"}
    assert not pool["p"].up and pool.due_for_probe() == ["p", "d"]
    assert pool.healthy("p") and pool.disaggregated
    # Listed again: nothing changes.
    changes = reconcile(pool, [info("p", "http://h:2", "prefill"), info("d", "h:3", "decode")],
                        found)
    assert changes.added == changes.removed == [] and pool["p"].up


def test_an_instance_the_master_drops_is_forgotten_once_idle_and_static_engines_stay(clock):
    pool = EnginePool([EngineSpec("static", "http://h:1")], clock=clock)
    found: set[str] = set()
    reconcile(pool, [info("a", "http://h:2"), info("b", "http://h:3")], found)
    ticket = pool.sent("a", 10)          # a request in flight on a
    changes = reconcile(pool, [], found)
    assert changes.removed == ["b"] and set(pool.engines) == {"static", "a"}
    pool.done("a", ticket)
    assert reconcile(pool, [], found).removed == ["a"] and set(pool.engines) == {"static"}
    assert found == set()


def test_an_instance_that_moved_is_replaced_and_bad_urls_are_refused(clock):
    pool = EnginePool([], clock=clock)
    found: set[str] = set()
    reconcile(pool, [info("a", "http://h:2")], found)
    changes = reconcile(pool, [info("a", "http://h:9", "decode"), info("x", "ftp://h")], found)
    assert changes.removed == ["a"] and [s.url for s in changes.added] == ["http://h:9"]
    assert pool["a"].spec.role == "decode"
    assert len(changes.refused) == 1 and changes.refused[0].startswith("x: invalid engine")


def test_the_routing_index_tells_each_live_instances_url_role_and_age(clock):
    idx = RoutingIndex(clock, instance_ttl_s=10)
    idx.apply("p", [])
    idx.announce("p", "http://h:2", "prefill")
    idx.apply("q", [])
    clock.advance(3)
    idx.apply("q", [])
    [p, q] = idx.describe()
    assert (p.instance_id, p.url, p.role, p.seen_s_ago) == ("p", "http://h:2", "prefill", 3)
    assert (q.url, q.role, q.seen_s_ago) == ("", "both", 0)
    with pytest.raises(InvalidArgument, match="unknown instance role 'bogus'"):
        idx.announce("p", "http://h:2", "bogus")
    clock.advance(8)
    idx.tick()
    assert [v.instance_id for v in idx.describe()] == ["q"]
