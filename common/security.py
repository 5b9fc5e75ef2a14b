"""Who a peer is, and the credential files that say so (SECURITY.md).

Every master, store node, client and admin holds an X.509 certificate signed by the cluster's
CA, with its role in the subject's OU and its name in the CN: ``OU=node, CN=node0`` is store
node ``node0``, ``OU=client, CN=<tenant>`` a client of that tenant, ``OU=admin``, ``OU=master``.
The gRPC port is mutual TLS (the lookup port's sessions are opened there: net/lookup_port.py);
the master reads the peer's certificate to know who calls (master/auth.py decides what each
role may do).

A credentials file is YAML naming three PEM files (relative paths from the file's directory)::

    ca: ca.pem        # the CA that signs every peer of the cluster
    cert: node0.pem   # this process's certificate
    key: node0.key    # its private key

A directory in Kubernetes' ``kubernetes.io/tls`` layout (``ca.crt``, ``tls.crt``, ``tls.key``:
what cert-manager writes, into a Secret or through its csi-driver into a pod) is read as the
file naming those three.

Where a process finds its own (:func:`resolve`): an explicit file (``--credentials``), else
the file ``KVPOOL_CREDENTIALS`` names, else the credentials a local cluster of this user
(``kvpool up``, tools/cluster.py) registered for the master address being dialled, else
none (plain text: a master without credentials serves only loopback unless ``--insecure``).
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import ipaddress
import json
import os
import stat
import tempfile
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

import yaml
from kvpool.common.errors import Unauthenticated

# "etcd": the certificate an etcd server serves TLS with (etcds://); it may call nothing.
ROLES = ("client", "node", "admin", "master", "etcd")
# Every master's certificate carries this name (besides its hosts), and clients check it
# instead of the host they dialled: a cluster's masters move between hosts and addresses
# (standbys, containers), and only the CA can give a certificate this name.
MASTER_NAME = "kvpool-master"
ENV = "KVPOOL_CREDENTIALS"


@dataclass(frozen=True)
class Identity:
    """A peer as its certificate names it."""

    role: str
    name: str

    def __str__(self) -> str:
        return f"{self.role}:{self.name}"


@dataclass(frozen=True)
class Credentials:
    """One process's credential files, loaded: the CA, and its certificate and key or, where
    certificates are impractical, a bearer token (for the master's token port)."""

    path: str          # the credentials file they came from (for messages)
    ca_file: str
    cert_file: str = ""
    key_file: str = ""
    token: str = ""
    token_identity: Identity | None = None   # what the token's file says it is (informative)

    @functools.cached_property
    def ca_pem(self) -> bytes:
        return Path(self.ca_file).read_bytes()

    @functools.cached_property
    def identity(self) -> Identity:
        if self.token:
            return self.token_identity or Identity("client", "?")
        return identity_from_pem(Path(self.cert_file).read_bytes())

    def grpc_server(self):
        """gRPC server credentials: TLS, client certificates required and checked."""
        import grpc
        return grpc.ssl_server_credentials(
            [(Path(self.key_file).read_bytes(), Path(self.cert_file).read_bytes())],
            root_certificates=self.ca_pem, require_client_auth=True)

    def grpc_server_tls_only(self):
        """gRPC server credentials of the token port: TLS, no client certificate asked (the
        caller is named by its bearer token)."""
        import grpc
        return grpc.ssl_server_credentials(
            [(Path(self.key_file).read_bytes(), Path(self.cert_file).read_bytes())])

    def grpc_channel(self):
        """gRPC channel credentials (with :data:`GRPC_CHANNEL_OPTIONS`): mutual TLS, or TLS
        with the token as ``authorization: Bearer`` metadata on every call."""
        import grpc
        if self.token:
            return grpc.composite_channel_credentials(
                grpc.ssl_channel_credentials(root_certificates=self.ca_pem),
                grpc.access_token_call_credentials(self.token))
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca_pem, private_key=Path(self.key_file).read_bytes(),
            certificate_chain=Path(self.cert_file).read_bytes())

    def etcd_channel(self):
        """gRPC channel credentials for etcd over TLS (``etcds://``): this CA checks etcd's
        certificate against the endpoint's host (``pki.issue(DIR, "etcd", NAME, hosts=...)``),
        and this process's certificate is its client certificate. A token cannot authenticate
        to etcd: InvalidArgument."""
        import grpc
        from kvpool.common.errors import InvalidArgument
        if self.token:
            raise InvalidArgument(f"etcds:// needs a certificate; {self.path} holds a token "
                                  "(etcd authenticates clients by certificate only)")
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca_pem, private_key=Path(self.key_file).read_bytes(),
            certificate_chain=Path(self.cert_file).read_bytes())

    def secure_channel(self, address: str, options=()):
        """A gRPC channel to the master at ``address`` with these credentials (raw callers:
        tools, tests; kvpool's own clients go through rpc/grpc_client.py)."""
        import grpc
        return grpc.secure_channel(address, self.grpc_channel(),
                                   options=[*options, *GRPC_CHANNEL_OPTIONS])


# The files of a credentials directory (Kubernetes' kubernetes.io/tls layout, cert-manager's).
TLS_DIRECTORY = {"ca": "ca.crt", "cert": "tls.crt", "key": "tls.key"}

# Channels check the master's certificate for MASTER_NAME, whatever address they dialled.
GRPC_CHANNEL_OPTIONS = [("grpc.ssl_target_name_override", MASTER_NAME)]


def load(path: str | os.PathLike) -> Credentials:
    """The credentials a YAML file names (or a directory holds: ``TLS_DIRECTORY``);
    Unauthenticated with the reason if they cannot be read (a missing file, a key that is not
    PEM...)."""
    path = Path(path)
    if path.is_dir():   # the kubernetes.io/tls layout, as cert-manager writes it
        base, data = path, dict(TLS_DIRECTORY)
    else:
        base = path.parent
        try:
            data = yaml.safe_load(path.read_text())
        except (OSError, yaml.YAMLError) as e:
            raise Unauthenticated(f"cannot read credentials file {path}: {e}") from None
    token = isinstance(data, dict) and "token" in data
    needed = {"ca", "token"} if token else {"ca", "cert", "key"}
    if not isinstance(data, dict) or not needed <= set(data):
        raise Unauthenticated(f"credentials file {path} must name ca, cert and key files "
                              "(or ca and a token)")
    files = {k: str((base / str(data[k])).resolve()) for k in needed - {"token"}}
    for what, name in files.items():
        if not os.access(name, os.R_OK):
            raise Unauthenticated(f"credentials file {path}: cannot read its {what} {name}")
    if token:
        said = Identity(str(data.get("role", "client")), str(data.get("name", "?")))
        return Credentials(str(path), files["ca"], token=str(data["token"]),
                           token_identity=said)
    creds = Credentials(str(path), files["ca"], files["cert"], files["key"])
    try:
        creds.identity   # noqa: B018 - a certificate without a role fails here, not at a call
    except ValueError as e:
        raise Unauthenticated(f"credentials file {path}: {e}") from None
    return creds


@functools.lru_cache(maxsize=4096)
def identity_from_pem(pem: bytes) -> Identity:
    """The identity a (verified) certificate names; ValueError if it names none. Cached: each
    peer's certificate is parsed once, not per call."""
    from cryptography import x509
    return _identity(x509.load_pem_x509_certificate(pem))


def _identity(cert) -> Identity:
    from cryptography.x509.oid import NameOID
    ous = cert.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)
    cns = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    role = str(ous[0].value) if ous else ""
    if role not in ROLES or not cns:
        raise ValueError(f"certificate {cert.subject.rfc4514_string()} names no kvpool role "
                         f"(OU one of {', '.join(ROLES)}) and name (CN)")
    return Identity(role, str(cns[0].value))


class Tokens:
    """The bearer tokens a master accepts on its token port, each bound to a role and name.
    The file holds only their SHA-256 (a copy of it grants nothing)::

        - {role: client, name: tenant-a, sha256: 9f86d0...}
    """

    def __init__(self, entries: list[tuple[Identity, bytes]]):
        self._entries = entries

    @classmethod
    def load(cls, path: str | os.PathLike) -> Tokens:
        try:
            data = yaml.safe_load(Path(path).read_text()) or []
            entries = [(Identity(str(e["role"]), str(e["name"])), bytes.fromhex(e["sha256"]))
                       for e in data]
        except (OSError, yaml.YAMLError, KeyError, TypeError, ValueError) as e:
            raise Unauthenticated(f"cannot read tokens file {path}: expected a list of "
                                  f"{{role, name, sha256}}: {e}") from None
        bad = [str(i) for i, _ in entries if i.role not in ROLES]
        if bad:
            raise Unauthenticated(f"tokens file {path}: unknown roles in {', '.join(bad)}")
        return cls(entries)

    def identify(self, authorization: str | None) -> Identity | None:
        """The identity an ``authorization: Bearer TOKEN`` header's token is bound to."""
        if not authorization or not authorization.startswith("Bearer "):
            return None
        digest = hashlib.sha256(authorization[7:].encode()).digest()
        found = None
        for identity, expected in self._entries:   # every entry compared: constant time
            if hmac.compare_digest(digest, expected):
                found = identity
        return found


# -- local clusters: where this user's clients find a cluster's credentials --

def registry_dir() -> Path:
    """Where local clusters of this user register their credentials, by master address. Only
    this uid may read it (0700): another user on the host finds nothing here."""
    return Path(os.environ.get("KVPOOL_CLUSTERS_DIR")
                or Path(tempfile.gettempdir()) / f"kvpool-{os.getuid()}" / "clusters")


def _private_dir(path: Path, create: bool) -> bool:
    """Whether ``path`` is a directory only this uid can use (made so if ``create``)."""
    if create:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        for p in (path.parent, path):
            if p.stat().st_uid == os.getuid():
                p.chmod(0o700)
    try:
        st = path.stat()
    except OSError:
        return False
    # Another user's (or a shared writable) directory could hand us their credentials.
    return st.st_uid == os.getuid() and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def _entry(address: str) -> Path:
    return registry_dir() / urllib.parse.quote(address, safe="")


def _process_start(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks since boot, from /proc; None when no such
    process lives): with the pid, it names one process even after the pid is reused."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def register(addresses: list[str], directory: str | os.PathLike) -> None:
    """Record that the cluster reached at each of ``addresses`` keeps its credentials (a CA
    and ``client.yaml``) in ``directory``, for as long as this process (the cluster's owner:
    its servers die with it) lives."""
    if not _private_dir(registry_dir(), create=True):
        raise PermissionError(f"{registry_dir()} is not a private directory of this user")
    owner = {"credentials": str(Path(directory).resolve()), "pid": os.getpid(),
             "started": _process_start(os.getpid())}
    for address in addresses:
        _entry(address).write_text(json.dumps(owner))


def unregister(addresses: list[str]) -> None:
    for address in addresses:
        _entry(address).unlink(missing_ok=True)


def registered(address: str) -> Path | None:
    """The credentials directory a live local cluster registered for ``address``, if any. The
    entry of a cluster whose owner is gone (killed before it could unregister) is removed:
    another server may listen on that port now, and it would be dialled with a dead cluster's
    credentials."""
    if not address or not _private_dir(registry_dir(), create=False):
        return None
    entry = _entry(address)
    try:
        owner = json.loads(entry.read_text())
        directory, pid, started = Path(owner["credentials"]), int(owner["pid"]), owner["started"]
    except OSError:
        return None
    except (ValueError, KeyError, TypeError):   # unreadable, or written by an older kvpool
        entry.unlink(missing_ok=True)
        return None
    if _process_start(pid) != started:
        entry.unlink(missing_ok=True)
        return None
    return directory if _private_dir(directory, create=False) else None


def resolve(master: str, explicit: str | os.PathLike | None = None, *, role: str = "client",
            name: str | None = None) -> Credentials | None:
    """The credentials a process dialling ``master`` uses (see the module): from a registered
    local cluster, ``role`` "client" gets its default client's, "admin" its admin's, and
    "node" with ``name`` its node id a node certificate, issued from the cluster's CA on first
    use (any process of this uid could read that CA's key anyway)."""
    if explicit:
        return load(explicit)
    if env := os.environ.get(ENV):
        creds = load(env)
        if role == "client" or creds.identity.role == role:
            return creds
    # A list of standby masters: any one of them registered names the cluster.
    directory = next(filter(None, map(registered, (master, *master.split(",")))), None)
    if directory is None:
        return None
    if role == "client":
        return load(directory / "client.yaml")
    if role == "admin":
        return load(directory / "admin-admin.yaml")
    from kvpool.common import pki
    return load(pki.ensure(directory, role, name or ""))


def is_loopback(host: str) -> bool:
    """Whether a listen address is reachable only from this host."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
