"""Where the master is: one address, a list of standby masters, or the leader named in etcd.

A ``--master`` value is one of
  ``HOST:PORT``                 one master (the behaviour of old: no failover);
  ``HOST:PORT,HOST:PORT,...``   standby masters: try them in turn, follow "not the leader" hints;
  ``etcd://HOST:PORT[,HOST:PORT][/CLUSTER]``   read the leader's address from etcd, under the
                                key the masters elect on (``leader_key(CLUSTER)``).
Both the client SDK and the store nodes find the leader through ``MasterTargets`` (in
``GrpcClient``); the masters themselves elect with master/ha.py on the same URL.
"""

from __future__ import annotations

import grpc
from kvpool.common.addresses import EtcdURL, parse_address, parse_etcd_url
from kvpool.common.errors import MasterUnavailable


def etcd_channel(url: EtcdURL, endpoint: str, credentials=None, aio: bool = False):
    """A channel to one of ``url``'s etcd endpoints: TLS with ``credentials`` (loaded
    kvpool credentials) for ``etcds://``, plain text for ``etcd://``."""
    module = grpc.aio if aio else grpc
    if not url.tls:
        return module.insecure_channel(endpoint)
    if credentials is None:
        raise MasterUnavailable("etcds:// (etcd over TLS) needs this process's credentials "
                                "(--credentials or KVPOOL_CREDENTIALS; SECURITY.md)")
    return module.secure_channel(endpoint, credentials.etcd_channel())


def read_leader(url: EtcdURL, timeout_s: float, credentials=None) -> str | None:
    """The leader's address as etcd holds it now (None: no leader elected), from the first
    endpoint that answers; MasterUnavailable when none does. Blocking; each call under
    ``timeout_s``. ``credentials``: for ``etcds://``; a token's: the leader's token port."""
    try:
        from aetcd.rpc import rpc_pb2, rpc_pb2_grpc
    except ImportError:
        raise MasterUnavailable("finding the master through etcd needs the aetcd package "
                                "(pip install aetcd)") from None
    errors = []
    for endpoint in url.endpoints:
        with etcd_channel(url, endpoint, credentials) as channel:
            try:
                key = url.tokens_key if credentials is not None and credentials.token \
                    else url.key
                r = rpc_pb2_grpc.KVStub(channel).Range(rpc_pb2.RangeRequest(key=key),
                                                       timeout=timeout_s)
            except grpc.RpcError as e:
                errors.append(f"{endpoint}: {e.code().name}")
                continue
        return r.kvs[0].value.decode() if r.kvs else None
    raise MasterUnavailable(f"no etcd endpoint answered ({'; '.join(errors)})")


class MasterTargets:
    """The masters a client may talk to, and which one to try next. Immutable."""

    def __init__(self, spec: str):
        spec = str(spec).strip()
        url = spec.startswith("etcd:") or "://" in spec    # http://... is a mistake: say so
        self.etcd: EtcdURL | None = parse_etcd_url(spec) if url else None
        self.addresses: tuple[str, ...] = () if self.etcd else tuple(
            parse_address(a.strip()) for a in spec.split(","))
        self.spec = spec

    @property
    def fails_over(self) -> bool:
        """False for one plain address: then nothing here changes the old behaviour."""
        return self.etcd is not None or len(self.addresses) > 1

    def first(self) -> str | None:
        """The address to dial before anything is known (None: ask etcd first)."""
        return self.addresses[0] if self.addresses else None

    def next(self, current: str | None, hint: str | None, timeout_s: float,
             credentials=None) -> str | None:
        """The address to try after ``current`` failed: the hint a standby gave, else the
        leader named in etcd (``credentials``: for ``etcds://``), else the next address of the
        list. None: nothing to try yet."""
        if hint:
            return parse_address(hint)
        if self.etcd is not None:
            return read_leader(self.etcd, timeout_s, credentials)
        if not self.addresses:
            return None
        after = self.addresses.index(current) + 1 if current in self.addresses else 0
        return self.addresses[after % len(self.addresses)]
