"""A cluster's own CA and the certificates it signs (``kvpool up``, ``kvpool credentials``),
made with the ``cryptography`` package. Layout of a credentials directory::

    ca.pem, ca.key               the CA (the key never leaves this directory)
    <role>-<name>.pem/.key/.yaml one identity: certificate, key, credentials file
    client.yaml                  the default client's credentials file (tenant "default")

Keys are ECDSA P-256 (a handshake signs in microseconds; RSA-2048 costs ~1 ms) and files are
written 0600 in a 0700 directory.
"""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
import os
import re
import socket
from pathlib import Path

from kvpool.common.security import MASTER_NAME, ROLES

CA_DAYS = 3650
CERT_DAYS = 365
NAME = re.compile(r"^[A-Za-z0-9._:@-]{1,128}$")


def write_private(path: Path, data: bytes) -> None:
    """Write ``path`` 0600 (also when it exists with another mode)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _key_pem(key) -> bytes:
    from cryptography.hazmat.primitives import serialization
    return key.private_bytes(serialization.Encoding.PEM,
                             serialization.PrivateFormat.PKCS8, serialization.NoEncryption())


def make_ca(directory: str | os.PathLike, name: str = "kvpool local CA") -> Path:
    """Create ``directory`` (0700) with a new CA in it, unless it has one; its ca.pem."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID
    directory = Path(directory)
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    if (directory / "ca.pem").exists():
        return directory / "ca.pem"
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=CA_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                           critical=False)
            .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False,
                                         False), critical=True)
            .sign(key, hashes.SHA256()))
    write_private(directory / "ca.key", _key_pem(key))
    from cryptography.hazmat.primitives import serialization
    write_private(directory / "ca.pem", cert.public_bytes(serialization.Encoding.PEM))
    return directory / "ca.pem"


def issue(directory: str | os.PathLike, role: str, name: str, hosts: tuple[str, ...] = (),
          days: int = CERT_DAYS) -> Path:
    """Sign a certificate for ``role``/``name`` with the CA in ``directory``; write it, its
    key and a credentials file naming them (returned). A master's also names MASTER_NAME and
    ``hosts``; an etcd server's (role ``etcd``, for ``etcds://``) names ``hosts`` only.
    Issuing again replaces the old files (rotation: see SECURITY.md)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}: expected one of {', '.join(ROLES)}")
    if not NAME.match(name):
        raise ValueError(f"invalid name {name!r} for a {role}: 1-128 of A-Z a-z 0-9 . _ : @ -")
    if role == "etcd" and not hosts:
        raise ValueError("an etcd server's certificate names the hosts it serves on: give hosts")
    directory = Path(directory)
    ca_key = serialization.load_pem_private_key((directory / "ca.key").read_bytes(), None)
    ca = x509.load_pem_x509_certificate((directory / "ca.pem").read_bytes())
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    builder = (x509.CertificateBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, role),
                                        x509.NameAttribute(NameOID.COMMON_NAME, name)]))
               .issuer_name(ca.subject).public_key(key.public_key())
               .serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=days))
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                              critical=False)
               .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                   ca.public_key()), critical=False))
    usages = [ExtendedKeyUsageOID.CLIENT_AUTH]
    if role in ("master", "etcd", "node"):   # a node serves its data port over TLS (--data-tls)
        usages.append(ExtendedKeyUsageOID.SERVER_AUTH)
        names = [x509.DNSName(MASTER_NAME)] if role == "master" else []
        if names or hosts:
            builder = builder.add_extension(x509.SubjectAlternativeName(
                [*names, *(_san(h) for h in hosts)]), critical=False)
    cert = builder.add_extension(x509.ExtendedKeyUsage(usages), critical=False).sign(
        ca_key, hashes.SHA256())
    stem = f"{role}-{name.replace(':', '_')}"
    write_private(directory / f"{stem}.key", _key_pem(key))
    write_private(directory / f"{stem}.pem", cert.public_bytes(serialization.Encoding.PEM))
    creds = directory / f"{stem}.yaml"
    write_private(creds, f"ca: ca.pem\ncert: {stem}.pem\nkey: {stem}.key\n".encode())
    return creds


def _san(host: str):
    from cryptography import x509
    try:
        return x509.IPAddress(ipaddress.ip_address(host.strip("[]")))
    except ValueError:
        return x509.DNSName(host)


def ensure(directory: str | os.PathLike, role: str, name: str) -> Path:
    """The credentials file of ``role``/``name`` in ``directory``, issued if it has none."""
    path = Path(directory) / f"{role}-{name.replace(':', '_')}.yaml"
    return path if path.exists() else issue(directory, role, name)


def make_local(directory: str | os.PathLike, host: str) -> Path:
    """A CA, a master certificate for ``host``, an admin and the default client
    (``client.yaml``, tenant "default") in ``directory``: what ``kvpool up`` needs. Returns
    the master's credentials file; node certificates are issued as nodes start
    (:func:`ensure`)."""
    directory = Path(directory)
    make_ca(directory)
    master = issue(directory, "master", "master",
                   hosts=tuple(dict.fromkeys((host, "127.0.0.1", "localhost",
                                              socket.gethostname()))))
    issue(directory, "admin", "admin")
    client = issue(directory, "client", "default")
    link = directory / "client.yaml"
    link.unlink(missing_ok=True)
    link.symlink_to(client.name)
    return master


def make_token(directory: str | os.PathLike, role: str, name: str) -> Path:
    """A new bearer token for ``role``/``name``: its SHA-256 appended to ``tokens.yaml`` (the
    master's ``--tokens`` file) and the token itself, with the CA, in a credentials file
    (returned) for the client that cannot hold a certificate."""
    import secrets

    import yaml
    if role not in ROLES or not NAME.match(name):
        raise ValueError(f"invalid role {role!r} or name {name!r}")
    directory = Path(directory)
    token = secrets.token_urlsafe(32)
    tokens = directory / "tokens.yaml"
    entries = (yaml.safe_load(tokens.read_text()) or []) if tokens.exists() else []
    entries.append({"role": role, "name": name,
                    "sha256": hashlib.sha256(token.encode()).hexdigest()})
    write_private(tokens, yaml.safe_dump(entries).encode())
    creds = directory / f"token-{role}-{name.replace(':', '_')}.yaml"
    write_private(creds, yaml.safe_dump({"ca": "ca.pem", "token": token, "role": role,
                                  "name": name}).encode())
    return creds
