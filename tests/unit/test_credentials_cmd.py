"""`kvpool credentials` (tools/credentials_cmd.py), run for real into temporary directories:
what it issues loads with kvpool's own loader as the identity asked for, a master and a client
it issued complete a mutual-TLS handshake, it keeps its CA across runs, and its exports and
Kubernetes Secrets carry the CA's key only where they say."""

from __future__ import annotations

import base64
import socket
import ssl
import stat
import threading
from pathlib import Path

import pytest
import yaml
from kvpool.common import security
from kvpool.tools.cli import main


def credentials(*args: str) -> int:
    return main(["credentials", *map(str, args)])


def cert(path: Path):
    from cryptography import x509
    return x509.load_pem_x509_certificate(path.read_bytes())


def test_issues_each_identity_as_asked(tmp_path, capsys):
    ca = tmp_path / "ca"
    assert credentials(ca, "--master", "--host", "10.0.0.5", "--host", "kv.example",
                       "--node", "node0", "--client", "tenant-a", "--admin", "ops") == 0
    out = capsys.readouterr().out
    assert "new CA" in out and "node node0" in out
    expected = {"master-master.yaml": ("master", "master"), "node-node0.yaml": ("node", "node0"),
                "client-tenant-a.yaml": ("client", "tenant-a"), "admin-ops.yaml": ("admin", "ops")}
    for name, (role, who) in expected.items():
        creds = security.load(ca / name)
        assert (creds.identity.role, creds.identity.name) == (role, who)
    # Keys and the directory are the owner's alone.
    assert stat.S_IMODE(ca.stat().st_mode) == 0o700
    assert {stat.S_IMODE(p.stat().st_mode) for p in ca.iterdir()} == {0o600}

    from cryptography import x509
    from cryptography.x509.oid import ExtendedKeyUsageOID
    master = cert(ca / "master-master.pem")
    san = master.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == [security.MASTER_NAME, "kv.example"]
    assert [str(a) for a in san.get_values_for_type(x509.IPAddress)] == ["10.0.0.5"]
    usages = master.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert ExtendedKeyUsageOID.SERVER_AUTH in usages


def test_a_master_and_a_client_it_issued_shake_hands(tmp_path):
    """The files work as TLS credentials: the client checks the master by kvpool-master, the
    master requires and verifies the client's certificate."""
    ca = tmp_path / "ca"
    assert credentials(ca, "--master", "--client", "default") == 0
    master = security.load(ca / "master-master.yaml")
    client = security.load(ca / "client-default.yaml")
    a, b = socket.socketpair()
    seen = {}

    def context(creds, purpose):
        ctx = ssl.create_default_context(purpose, cafile=creds.ca_file)
        ctx.load_cert_chain(creds.cert_file, creds.key_file)
        ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx

    def serve():
        with context(master, ssl.Purpose.CLIENT_AUTH).wrap_socket(a, server_side=True) as s:
            seen["peer"] = security.identity_from_pem(ssl.DER_cert_to_PEM_cert(
                s.getpeercert(binary_form=True)).encode())
            s.sendall(b"ok")

    t = threading.Thread(target=serve)
    t.start()
    with context(client, ssl.Purpose.SERVER_AUTH).wrap_socket(
            b, server_hostname=security.MASTER_NAME) as s:
        assert s.recv(2) == b"ok"
    t.join(10)
    assert seen["peer"] == security.Identity("client", "default")


def test_a_second_run_keeps_the_ca_and_renews_the_certificates(tmp_path):
    ca = tmp_path / "ca"
    assert credentials(ca, "--node", "node0") == 0
    ca_pem, first = (ca / "ca.pem").read_bytes(), cert(ca / "node-node0.pem")
    assert credentials(ca, "--node", "node0", "--days", "30") == 0
    assert (ca / "ca.pem").read_bytes() == ca_pem
    second = cert(ca / "node-node0.pem")
    assert second.serial_number != first.serial_number
    lifetime = second.not_valid_after_utc - second.not_valid_before_utc
    assert lifetime.days == 30


def test_ca_from_takes_an_existing_ca(tmp_path):
    assert credentials(tmp_path / "first", "--client", "x") == 0
    # A read-only copy, as a Kubernetes Secret is mounted.
    mounted = tmp_path / "mounted"
    mounted.mkdir()
    for f in ("ca.pem", "ca.key"):
        (mounted / f).write_bytes((tmp_path / "first" / f).read_bytes())
        (mounted / f).chmod(0o400)
    assert credentials(tmp_path / "second", "--ca-from", mounted, "--node", "n") == 0
    assert (tmp_path / "second" / "ca.pem").read_bytes() == (mounted / "ca.pem").read_bytes()
    # An empty --ca-from (a Secret not made yet, mounted optional) means a new CA.
    empty = tmp_path / "empty"
    empty.mkdir()
    assert credentials(tmp_path / "third", "--ca-from", empty, "--node", "n") == 0
    assert (tmp_path / "third" / "ca.pem").read_bytes() != (mounted / "ca.pem").read_bytes()


def test_export_gives_each_identity_its_own_directory_without_the_ca_key(tmp_path):
    ca, out = tmp_path / "ca", tmp_path / "out"
    assert credentials(ca, "--master", "--node", "node-1", "--export", out) == 0
    assert sorted(p.name for p in out.iterdir()) == ["master-master", "node-node-1"]
    for d in out.iterdir():
        assert sorted(p.name for p in d.iterdir()) == sorted(
            ["ca.pem", f"{d.name}.pem", f"{d.name}.key", f"{d.name}.yaml"])
        assert stat.S_IMODE(d.stat().st_mode) == 0o700
        assert security.load(d / f"{d.name}.yaml").identity.name == d.name.split("-", 1)[1]


def test_kubernetes_secrets_are_valid_and_hold_the_ca_key_in_one(tmp_path):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    ca, manifest = tmp_path / "ca", tmp_path / "secrets.yaml"
    assert credentials(ca, "--master", "--node", "n-0", "--node", "n-1", "--client", "default",
                       "--admin", "ops", "--kubernetes-secrets", manifest, "--secret-prefix",
                       "kv", "--namespace", "llm", "--label", "app.kubernetes.io/part-of=kvpool",
                       ) == 0
    items = yaml.safe_load(manifest.read_text())["items"]
    secrets = {s["metadata"]["name"]: s for s in items}
    assert list(secrets) == ["kv-ca", "kv-master", "kv-store-node", "kv-client-default",
                             "kv-admin-ops"]
    for s in items:
        kubernetes_validate.validate(s, "1.37.0", strict=True)
        assert s["metadata"]["namespace"] == "llm"
        assert s["metadata"]["labels"] == {"app.kubernetes.io/part-of": "kvpool"}
        assert ("ca.key" in s["data"]) == (s["metadata"]["name"] == "kv-ca")
    assert sorted(secrets["kv-store-node"]["data"]) == sorted(
        ["ca.pem"] + [f"node-n-{i}.{e}" for i in (0, 1) for e in ("pem", "key", "yaml")])
    # A Secret mounted as a directory is a directory of loadable credentials files.
    mount = tmp_path / "mount"
    mount.mkdir()
    for key, value in secrets["kv-store-node"]["data"].items():
        (mount / key).write_bytes(base64.b64decode(value))
    assert security.load(mount / "node-n-1.yaml").identity == security.Identity("node", "n-1")


@pytest.mark.parametrize("args, message", [
    (["--node", "bad name"], "invalid name 'bad name' for a node"),
    (["--host", "10.0.0.5"], "give --master too"),
    (["--client", "Tenant", "--kubernetes-secrets", "s.yaml"], "is not one Kubernetes takes"),
    (["--client", "a@b", "--kubernetes-secrets", "s.yaml", "--secret-prefix", "kv"],
     "is not one Kubernetes takes"),
    (["--label", "novalue", "--node", "n"], "expected KEY=VALUE"),
])
def test_mistakes_are_refused_before_anything_is_written(tmp_path, capsys, args, message):
    ca = tmp_path / "ca"
    assert credentials(ca, *args) == 2
    assert message in capsys.readouterr().err
    assert not ca.exists()


def test_a_half_ca_is_refused(tmp_path, capsys):
    half = tmp_path / "half"
    half.mkdir()
    (half / "ca.pem").write_text("x")
    assert credentials(tmp_path / "ca", "--ca-from", half, "--node", "n") == 2
    assert "has no ca.key" in capsys.readouterr().err
    assert credentials(half, "--node", "n") == 2
    assert "no ca.key" in capsys.readouterr().err


def test_days_must_be_positive(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        credentials(tmp_path / "ca", "--days", "0")
    assert e.value.code == 2 and "expected a whole number >= 1" in capsys.readouterr().err
