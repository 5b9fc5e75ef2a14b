"""Transport registry: preference order, lazy imports, choice per node."""

from __future__ import annotations

import subprocess
import sys

import pytest
from kvpool.client.transport.registry import (
    TRANSPORT_PREFERENCE,
    create_transports,
    pick,
    unavailable_reason,
)
from kvpool.client.transport.shm import SHMTransport
from kvpool.client.transport.tcp import TCPTransport
from kvpool.common.errors import InvalidArgument, TransportError
from kvpool.common.host import local_boot_id
from kvpool.common.types import NodeEndpoints


def close_all(transports):
    for t in transports:
        t.close()


def test_default_is_every_usable_transport_in_preference_order():
    assert TRANSPORT_PREFERENCE == ("shm", "rdma", "tcp")
    transports = create_transports()
    rdma = [] if unavailable_reason("rdma") else ["rdma"]
    assert [t.scheme for t in transports] == ["shm", *rdma, "tcp"]
    assert isinstance(transports[0], SHMTransport) and isinstance(transports[-1], TCPTransport)
    close_all(transports)


def test_rdma_without_a_device_is_refused_with_the_reason():
    reason = unavailable_reason("rdma")
    if not reason:
        pytest.skip("this host has RDMA")
    with pytest.raises(TransportError, match="rdma transport unavailable"):
        create_transports(["rdma"])


def test_enabled_order_does_not_override_preference():
    transports = create_transports(["tcp", "shm"])
    assert [t.scheme for t in transports] == ["shm", "tcp"]
    close_all(transports)
    transports = create_transports(["tcp"], options={"tcp": {"timeout_s": 1.5}})
    assert [t.scheme for t in transports] == ["tcp"]
    close_all(transports)


@pytest.mark.parametrize("enabled, match", [(["udp"], "unknown transport"),
                                            ("tcp", "sequence")])
def test_bad_choices_are_refused(enabled, match):
    with pytest.raises(InvalidArgument, match=match):
        create_transports(enabled)


def test_options_for_a_transport_not_enabled_are_refused():
    with pytest.raises(InvalidArgument):
        create_transports(["tcp"], options={"shm": {}})


def test_pick_prefers_shm_on_the_same_host_and_tcp_elsewhere():
    transports = create_transports()
    here = NodeEndpoints("n", local_boot_id(), "127.0.0.1:1", "kvpool-x")
    there = NodeEndpoints("m", "other-boot-id", "10.0.0.2:1", "kvpool-y")
    tcp_only = NodeEndpoints("o", local_boot_id(), "127.0.0.1:2", "")
    nothing = NodeEndpoints("p", "other-boot-id", "", "")
    assert pick(transports, here).scheme == "shm"
    assert pick(transports, there).scheme == "tcp"
    assert pick(transports, tcp_only).scheme == "tcp"
    assert pick(transports, nothing) is None
    close_all(transports)


def test_registry_import_is_lazy():
    code = ("import sys, kvpool.client.transport.registry as r; "
            "assert 'kvpool.client.transport.tcp' not in sys.modules; "
            "assert 'kvpool.client.transport.shm' not in sys.modules; "
            "assert 'pyverbs' not in sys.modules and 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)
