"""Scheme -> transport factory, and the client's per-replica choice among transports.

Factories are ``"module:attribute"`` strings imported on first use, so a transport with heavy or
optional dependencies (rdma: pyverbs) costs nothing at client import time and is only imported
where it is enabled.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kvpool.client.transport.base import Transport
from kvpool.common.errors import InvalidArgument
from kvpool.common.types import NodeEndpoints

TRANSPORT_PREFERENCE = ("shm", "rdma", "tcp")

TransportFactory = Callable[..., Transport]

_FACTORIES: dict[str, str | TransportFactory] = {
    "shm": "kvpool.client.transport.shm:SHMTransport",
    "rdma": "kvpool.client.transport.rdma:RDMATransport",
    "tcp": "kvpool.client.transport.tcp:TCPTransport",
}

# Schemes that depend on this host: "module:function" returning "" where the transport can be
# used, else why not. By default such a transport is enabled only where it can be used; asked
# for explicitly where it cannot, its constructor raises TransportError with the reason.
_PROBES: dict[str, str] = {
    "rdma": "kvpool.net.rdma_probe:unavailable_reason",
}

# Known schemes without an implementation yet: skipped by default, refused when asked for.
_PLANNED: dict[str, str] = {}


def register_transport(scheme: str, factory: str | TransportFactory) -> None:
    """Register (or replace) the factory for ``scheme``: a callable or ``"module:attr"``."""
    if scheme not in TRANSPORT_PREFERENCE:
        raise InvalidArgument(f"unknown transport {scheme!r}; known: {TRANSPORT_PREFERENCE}")
    _FACTORIES[scheme] = factory
    _PLANNED.pop(scheme, None)


def unavailable_reason(scheme: str) -> str:
    """"" if ``scheme`` can be used on this host, else why not (e.g. no RDMA device)."""
    probe = _PROBES.get(scheme)
    if probe is None:
        return ""
    module, _, attr = probe.partition(":")
    return getattr(importlib.import_module(module), attr)()


def _resolve(scheme: str) -> TransportFactory:
    factory = _FACTORIES[scheme]
    if isinstance(factory, str):
        module, _, attr = factory.partition(":")
        factory = getattr(importlib.import_module(module), attr)
    return factory


def create_transports(enabled: Sequence[str] | None = None, *,
                      options: Mapping[str, Mapping[str, Any]] | None = None
                      ) -> list[Transport]:
    """Instantiate the enabled transports, in preference order (shm, rdma, tcp).

    ``enabled=None`` means every implemented transport this host can use (rdma only where
    there is a device). An unknown scheme raises InvalidArgument; rdma asked for where there is
    no device raises TransportError saying why. ``options[scheme]`` are keyword arguments
    for that transport's constructor (e.g. ``{"tcp": {"timeout_s": 5}}``).
    """
    if isinstance(enabled, str):
        raise InvalidArgument("enabled must be a sequence of scheme names, not a string")
    if enabled is None:
        wanted = [s for s in TRANSPORT_PREFERENCE
                  if s in _FACTORIES and not unavailable_reason(s)]
    else:
        for scheme in enabled:
            if scheme in _PLANNED:
                raise InvalidArgument(_PLANNED[scheme])
            if scheme not in _FACTORIES:
                raise InvalidArgument(
                    f"unknown transport {scheme!r}; known: {', '.join(TRANSPORT_PREFERENCE)}")
        wanted = [s for s in TRANSPORT_PREFERENCE if s in enabled]
    options = options or {}
    unknown = set(options) - set(wanted)
    if unknown:
        raise InvalidArgument(f"options given for transports not enabled: {sorted(unknown)}")
    transports: list[Transport] = []
    try:
        for scheme in wanted:
            transports.append(_resolve(scheme)(**options.get(scheme, {})))
    except BaseException:
        for t in transports:
            t.close()
        raise
    return transports


def pick(transports: Sequence[Transport], node: NodeEndpoints) -> Transport | None:
    """The first transport (they are in preference order) that can reach ``node``, or None."""
    for transport in transports:
        if transport.can_reach(node):
            return transport
    return None
