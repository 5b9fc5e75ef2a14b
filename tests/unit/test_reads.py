from kvpool.master.reads import MAX_NAMESPACES, OTHER, LeaseCount, NamespaceLookups, namespace_of


def test_a_keys_namespace_is_its_first_components():
    assert namespace_of("kvpool/vllm1/ab12/cd34/layer.0/0", 3) == "kvpool/vllm1/ab12"
    assert namespace_of("tenant/x", 3) == "tenant"       # fewer: all but the last
    assert namespace_of("plain", 3) == ""
    assert namespace_of("a/b/c/d", 1) == "a"


def test_lookups_are_counted_by_the_batchs_first_key_and_bounded():
    n = NamespaceLookups(depth=1)
    n.count("a/1", hits=3, misses=1)
    n.count("a/2", hits=1, misses=0)
    n.count(b"not a str", hits=1, misses=0)   # a malformed key names no namespace
    assert n.counts == {"a": [4, 1]}
    for i in range(2 * MAX_NAMESPACES):
        n.count(f"t{i}/k", hits=1, misses=0)
    assert len(n.counts) == MAX_NAMESPACES + 1 and n.counts[OTHER][0] == MAX_NAMESPACES + 1


def test_depth_zero_counts_nothing():
    n = NamespaceLookups(depth=0)
    n.count("a/1", hits=1, misses=1)
    assert n.counts == {}


def test_live_leases_are_the_grants_not_expired_yet():
    leases = LeaseCount()
    leases.granted(until=5.0, keys=3, now=0.0)
    leases.granted(until=6.0, keys=2, now=1.0)
    leases.granted(until=6.5, keys=0, now=1.5)     # a batch of misses only: nothing leased
    assert leases.live(4.9) == 5
    assert leases.live(5.0) == 2                   # the first batch's leases ended
    leases.granted(until=11.0, keys=1, now=6.0)    # expires the rest as it goes
    assert leases.live(6.0) == 1 and leases.live(11.0) == 0
