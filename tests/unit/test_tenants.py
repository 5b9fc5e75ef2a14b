"""Tenants' namespaces (common/tenants.py) and quotas (master/quotas.py): every stored key names
exactly one tenant and one key, whatever the keys and tenant names."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kvpool.common import tenants
from kvpool.common.config import ConfigError, MasterConfig, parse_quotas
from kvpool.common.errors import InvalidArgument, QuotaExceeded
from kvpool.master.quotas import TenantUsage

names = st.text(min_size=1, max_size=64).filter(
    lambda t: tenants.MARK not in t and len(t.encode("utf-8", "replace")) <= 64)
keys = st.text(min_size=1, max_size=40)


@given(names, keys)
def test_a_stored_key_names_its_tenant_and_key(tenant, key):
    stored = tenants.scoped(tenant, key)
    assert tenants.tenant_of(stored) == (tenant, key)


@given(names, keys, names, keys)
def test_two_tenants_keys_never_meet(t1, k1, t2, k2):
    if (t1, k1) != (t2, k2):
        assert tenants.scoped(t1, k1) != tenants.scoped(t2, k2)


def test_the_default_tenant_keeps_its_keys_and_admins_name_stored_keys():
    assert tenants.scoped("default", "a/b") == "a/b"
    assert tenants.scoped("", tenants.scoped("t", "k")) == tenants.scoped("t", "k")
    assert tenants.scoped_all("default", ["a", "b"]) is None      # untouched: no copy
    assert tenants.scoped_all("t", ["a"]) == [tenants.scoped("t", "a")]


def test_stored_keys_keep_the_clients_limits():
    tenants.validate_stored_key(tenants.scoped("t" * 64, "k" * 1024))
    with pytest.raises(InvalidArgument, match="1024"):
        tenants.validate_stored_key(tenants.scoped("t", "k" * 1025))
    with pytest.raises(InvalidArgument, match="namespace"):
        tenants.validate_stored_key(f"{tenants.MARK}{'t' * 65}{tenants.MARK}k")


def test_quotas_count_each_objects_size_once_per_tenant():
    usage = TenantUsage({"a": 100, "*": 10})
    usage.added(tenants.scoped("a", "x"), 60)
    usage.check(tenants.scoped("a", "y"), 40)
    with pytest.raises(QuotaExceeded, match="'a' holds 60 B in 1 objects"):
        usage.check(tenants.scoped("a", "y"), 41)
    with pytest.raises(QuotaExceeded):
        usage.check(tenants.scoped("b", "y"), 11)     # "*": every tenant not named
    usage.check("default-key", 10)
    usage.removed(tenants.scoped("a", "x"), 60)
    assert usage.table() == ()
    assert TenantUsage().quota("a") is None


@pytest.mark.parametrize("text, message", [("a", "NAME=SIZE"), ("=1GiB", "NAME=SIZE"),
                                           ("a=1GiB,a=2GiB", "two quotas"),
                                           ("a=lots", "lots")])
def test_bad_quota_settings_are_explained(text, message):
    with pytest.raises(ConfigError, match=message):
        MasterConfig(tenant_quotas=text)


def test_quota_settings():
    assert parse_quotas(" tenant-a = 10GiB , *=1KiB") == {"tenant-a": 10 << 30, "*": 1024}
    assert parse_quotas("") == {}
