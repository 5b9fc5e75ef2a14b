"""Master addresses as users write them: ``host:port``, and the ``etcd://`` URL of an HA
cluster (the masters elect on it, clients and nodes find the leader through it); ``etcds://``:
the same etcd over TLS, each process authenticating with its kvpool credentials (SECURITY.md
"etcd")."""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.common.errors import InvalidArgument

DEFAULT_CLUSTER = "default"
# Trailing metadata a standby master answers with: the leader's address, when it knows it.
LEADER_METADATA = "kvpool-leader"
_ETCD = "etcd://"
_ETCDS = "etcds://"


def leader_key(cluster: str) -> bytes:
    """The etcd key the leader of ``cluster`` holds (bound to its lease) with its address."""
    return f"/kvpool/{cluster}/leader".encode()


def parse_address(address: str, what: str = "master address",
                  example: str = "127.0.0.1:50051") -> str:
    """Validate ``host:port``; return it unchanged."""
    host, sep, port = str(address).rpartition(":")
    if (not sep or not host or "/" in host or host != host.strip() or not port.isdigit()
            or not 0 < int(port) < 65536):
        raise InvalidArgument(f"invalid {what} {address!r}: expected host:port, e.g. {example}")
    return address


@dataclass(frozen=True)
class EtcdURL:
    """A parsed ``etcd://HOST:PORT[,HOST:PORT][/CLUSTER]`` (``tls``: ``etcds://``)."""
    endpoints: tuple[str, ...]
    cluster: str = DEFAULT_CLUSTER
    tls: bool = False

    @property
    def key(self) -> bytes:
        return leader_key(self.cluster)

    @property
    def tokens_key(self) -> bytes:
        """Where the leader names its token port (``--tokens``), for token clients."""
        return leader_key(self.cluster) + b"-tokens"


def is_etcd_url(spec: str) -> bool:
    return str(spec).startswith((_ETCD, _ETCDS))


def parse_etcd_url(url: str) -> EtcdURL:
    """Parse an ``etcd://`` or ``etcds://`` URL; InvalidArgument says what is wrong with a bad
    one."""
    example = ("e.g. etcd://127.0.0.1:2379, etcd://10.0.0.1:2379,10.0.0.2:2379/prod or "
               "etcds://10.0.0.1:2379 (TLS)")
    tls = str(url).startswith(_ETCDS)
    if not tls and not str(url).startswith(_ETCD):
        raise InvalidArgument(f"invalid etcd URL {url!r}: expected etcd://HOST:PORT[/CLUSTER], "
                              f"{example}")
    hosts, _, cluster = url[len(_ETCDS if tls else _ETCD):].partition("/")
    cluster = cluster.strip("/") or DEFAULT_CLUSTER
    if not hosts or "/" in cluster or not cluster.replace("-", "").replace("_", "").isalnum():
        raise InvalidArgument(f"invalid etcd URL {url!r}: expected etcd://HOST:PORT[/CLUSTER] "
                              f"(CLUSTER: letters, digits, - and _), {example}")
    endpoints = tuple(parse_address(h, "etcd endpoint", "127.0.0.1:2379")
                      for h in hosts.split(","))
    return EtcdURL(endpoints, cluster, tls)
