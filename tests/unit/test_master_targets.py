"""How a ``--master`` value is read, and which master a client tries next (rpc/leader.py)."""

from __future__ import annotations

import pytest
from kvpool.common.addresses import leader_key, parse_address, parse_etcd_url
from kvpool.common.errors import InvalidArgument, MasterUnavailable
from kvpool.rpc.leader import MasterTargets


def test_one_address_does_not_fail_over():
    t = MasterTargets("127.0.0.1:50051")
    assert not t.fails_over and t.first() == "127.0.0.1:50051" and t.etcd is None


def test_a_list_is_tried_in_turn_and_a_hint_wins():
    t = MasterTargets("a:1, b:2,c:3")
    assert t.fails_over and t.first() == "a:1"
    assert t.next("a:1", None, 1.0) == "b:2"
    assert t.next("b:2", None, 1.0) == "c:3"
    assert t.next("c:3", None, 1.0) == "a:1"
    assert t.next("a:1", "c:3", 1.0) == "c:3"     # a standby named the leader


def test_etcd_url_names_the_endpoints_and_the_election_key():
    u = parse_etcd_url("etcd://10.0.0.1:2379,10.0.0.2:2379/prod-1")
    assert u.endpoints == ("10.0.0.1:2379", "10.0.0.2:2379") and u.cluster == "prod-1"
    assert u.key == leader_key("prod-1") == b"/kvpool/prod-1/leader"
    assert parse_etcd_url("etcd://h:2379").key == b"/kvpool/default/leader"
    t = MasterTargets("etcd://127.0.0.1:1")
    assert t.fails_over and t.first() is None
    assert not u.tls and parse_etcd_url("etcds://10.0.0.1:2379/prod") == \
        type(u)(("10.0.0.1:2379",), "prod", tls=True)
    assert MasterTargets("etcds://h:1").etcd.tls


@pytest.mark.parametrize("spec", ["etcd:/h:1", "http://h:1", "etcd://", "etcd://h:x",
                                  "etcd://h:1/a/b", "etcd://h:1/sp ace", "h", "h:0", ":1", "etcds://",
                                  "a:1,,b:2", "a/b:1"])
def test_bad_specs_are_refused_with_a_reason(spec):
    with pytest.raises(InvalidArgument, match="invalid"):
        MasterTargets(spec)


def test_parse_address_names_what_it_parses():
    with pytest.raises(InvalidArgument, match="invalid etcd endpoint 'x'.*127.0.0.1:2379"):
        parse_etcd_url("etcd://x")
    assert parse_address("host:1") == "host:1"


def test_an_unreachable_etcd_is_master_unavailable():
    # Port 1 on loopback refuses at once: a typed error naming the endpoint, no traceback.
    with pytest.raises(MasterUnavailable, match="127.0.0.1:1"):
        MasterTargets("etcd://127.0.0.1:1").next(None, None, 1.0)
