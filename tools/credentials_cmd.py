"""``kvpool credentials``: a cluster's CA and the certificates it signs, for deployments that
are not ``kvpool up`` (which makes its own): a multi-host cluster, compose, Kubernetes.

It wraps common/pki.py: the CA and every identity live in one directory (CA_DIR), which must
stay with the operator (it holds ca.key). ``--export`` copies each identity just issued, with
the CA certificate but not its key, to a directory of its own, ready to mount or copy to the
host that runs it; ``--kubernetes-secrets`` writes them as Secret manifests (what the Helm
chart's hook Job applies, and what its ``security.existingSecret`` expects).
"""

from __future__ import annotations

import argparse
import base64
import re
import sys
from pathlib import Path

from kvpool.common import pki
from kvpool.tools.argtypes import count_type

EXAMPLES = """\
examples:
  # a CA (once) and a master reachable as 10.0.0.5, two store nodes, one tenant's client
  kvpool credentials creds --master --host 10.0.0.5 --node node0 --node node1 --client tenant-a
  kvpool master --host 0.0.0.0 --credentials creds/master-master.yaml
  kvpool store-node --master 10.0.0.5:50051 --node-id node0 --credentials creds/node-node0.yaml
  KVPOOL_CREDENTIALS=creds/client-tenant-a.yaml python3 my_engine.py

  # the same, each identity also in a directory of its own without the CA key
  kvpool credentials creds --master --node node0 --export out   # out/master-master/, out/node-node0/

  # Kubernetes Secrets for the Helm chart's security.existingSecret=kv
  kvpool credentials creds --master --node kv-kvpool-store-node-0 --client default \\
      --kubernetes-secrets secrets.yaml --secret-prefix kv --namespace llm
  kubectl apply -f secrets.yaml

Running it again keeps the CA and issues the named certificates anew (rotation: restart the
processes that hold them; SECURITY.md). Keep CA_DIR offline: whoever holds ca.key can act as
any peer of the cluster.
"""

# What Kubernetes takes as a Secret's name (a DNS subdomain) and as a key of its data.
_SECRET_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
_SECRET_KEY = re.compile(r"^[-._a-zA-Z0-9]+$")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = ("Make a cluster's CA (unless CA_DIR has one) and issue certificates "
                     "signed by it: one per master, store node, client (tenant) and admin, "
                     "each with a credentials file (ca, cert, key) that --credentials or "
                     "KVPOOL_CREDENTIALS names. The role goes in the certificate's OU, the "
                     "name in its CN; a master's also names kvpool-master, which clients "
                     "check (SECURITY.md).")
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = EXAMPLES
    p.add_argument("directory", metavar="CA_DIR",
                   help="the CA's directory (created 0700): ca.pem, ca.key and every identity "
                        "issued, as ROLE-NAME.pem/.key/.yaml")
    p.add_argument("--ca-from", metavar="DIR",
                   help="take the CA (ca.pem, ca.key) from DIR when CA_DIR has none, e.g. a "
                        "read-only mount of the CA's Secret; a new CA is made only when "
                        "neither has one")
    p.add_argument("--master", action="store_true",
                   help="issue the master's certificate (all masters of a cluster may share "
                        "it): CN master, DNS:kvpool-master and each --host")
    p.add_argument("--host", action="append", default=[], metavar="HOST",
                   help="with --master: an address or DNS name the master is also known by "
                        "(for other TLS clients: kvpool's own check the name kvpool-master); "
                        "repeatable")
    p.add_argument("--node", action="append", default=[], metavar="ID",
                   help="a store node's certificate for node id ID (its --node-id; the "
                        "master lets a node act only as that id); repeatable")
    p.add_argument("--client", action="append", default=[], metavar="TENANT",
                   help="a client's certificate for tenant TENANT; repeatable")
    p.add_argument("--admin", action="append", default=[], metavar="NAME",
                   help="an admin's certificate (a client that may also audit); repeatable")
    from kvpool.common.pki import CERT_DAYS
    p.add_argument("--days", type=count_type, default=CERT_DAYS, metavar="N",
                   help="how long the certificates issued now are valid (default: %(default)s; "
                        "a new CA: 10 years)")
    p.add_argument("--export", metavar="DIR",
                   help="also copy each identity issued now to DIR/ROLE-NAME/ (its "
                        "credentials file, certificate, key and ca.pem; never ca.key)")
    p.add_argument("--kubernetes-secrets", metavar="FILE",
                   help="also write the identities issued now as Kubernetes Secrets to FILE "
                        "(a List for `kubectl apply -f`): PREFIX-ca (ca.pem, ca.key, and as "
                        "tls.crt, tls.key for a cert-manager CA Issuer), "
                        "PREFIX-master, PREFIX-store-node (every --node), "
                        "PREFIX-client-TENANT, PREFIX-admin-NAME")
    p.add_argument("--secret-prefix", metavar="PREFIX", default="kvpool-credentials",
                   help="with --kubernetes-secrets: the Secrets' name prefix "
                        "(default: kvpool-credentials)")
    p.add_argument("--namespace", metavar="NS",
                   help="with --kubernetes-secrets: the Secrets' namespace (default: "
                        "kubectl's)")
    p.add_argument("--label", action="append", default=[], metavar="KEY=VALUE",
                   help="with --kubernetes-secrets: a label for every Secret; repeatable")


def run(args: argparse.Namespace) -> int:
    try:
        made = issue(args)
    except ValueError as e:
        print(f"kvpool credentials: error: {e}", file=sys.stderr)
        return 2
    for line in made:
        print(line)
    return 0


def issue(args: argparse.Namespace) -> list[str]:
    """Do what ``args`` ask; the lines to print. ValueError names what is wrong before a
    file is written."""
    if args.host and not args.master:
        raise ValueError("--host names the master's addresses: give --master too")
    labels = {}
    for label in args.label:
        key, sep, value = label.partition("=")
        if not sep or not key:
            raise ValueError(f"--label {label!r}: expected KEY=VALUE")
        labels[key] = value
    identities = ([("master", "master")] if args.master else []) + [
        ("node", n) for n in args.node] + [("client", n) for n in args.client] + [
        ("admin", n) for n in args.admin]
    for role, name in identities:
        if not pki.NAME.match(name):   # all checked before anything is written
            raise ValueError(f"invalid name {name!r} for a {role}: 1-128 of A-Z a-z 0-9 "
                             ". _ : @ -")
    if args.kubernetes_secrets:
        _check_secret_names(args.secret_prefix, identities)

    directory = Path(args.directory)
    lines = []
    if not (directory / "ca.pem").exists() and args.ca_from:
        source = Path(args.ca_from)
        missing = [f for f in ("ca.pem", "ca.key") if not (source / f).is_file()]
        if len(missing) == 1:
            raise ValueError(f"--ca-from {source}: has no {missing[0]} (a CA needs both "
                             "ca.pem and ca.key)")
        if not missing:
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            for f in ("ca.pem", "ca.key"):
                pki.write_private(directory / f, (source / f).read_bytes())
            lines.append(f"CA taken from {source}")
    if not (directory / "ca.pem").exists():
        pki.make_ca(directory)
        lines.append(f"new CA: {directory / 'ca.pem'} (keep {directory / 'ca.key'} offline)")
    elif not (directory / "ca.key").exists():
        raise ValueError(f"{directory} has ca.pem but no ca.key: cannot sign with it")
    elif not lines:
        lines.append(f"CA: {directory / 'ca.pem'}")

    issued = []
    for role, name in identities:
        hosts = tuple(args.host) if role == "master" else ()
        creds = pki.issue(directory, role, name, hosts=hosts, days=args.days)
        issued.append((role, name, creds))
        lines.append(f"{role} {name}: {creds}")
    if args.export:
        for role, name, creds in issued:
            out = export(creds, Path(args.export))
            lines.append(f"exported {role} {name}: {out}")
    if args.kubernetes_secrets:
        text = kubernetes_secrets(directory, issued, args.secret_prefix, args.namespace, labels)
        pki.write_private(Path(args.kubernetes_secrets), text.encode())
        lines.append(f"Kubernetes Secrets: {args.kubernetes_secrets} "
                     f"(kubectl apply -f {args.kubernetes_secrets})")
    return lines


def _files(creds: Path) -> list[Path]:
    """The files one identity's credentials file names, itself included (not the CA)."""
    stem = creds.stem
    return [creds, creds.with_name(f"{stem}.pem"), creds.with_name(f"{stem}.key")]


def export(creds: Path, root: Path) -> Path:
    """Copy one identity (and ca.pem) to ``root/ROLE-NAME/``; that directory."""
    out = root / creds.stem
    out.mkdir(mode=0o700, parents=True, exist_ok=True)
    for f in [creds.with_name("ca.pem"), *_files(creds)]:
        pki.write_private(out / f.name, f.read_bytes())
    return out / creds.name


def _check_secret_names(prefix: str, identities: list[tuple[str, str]]) -> None:
    names = [f"{prefix}-ca", f"{prefix}-master", f"{prefix}-store-node"] + [
        f"{prefix}-{role}-{name}" for role, name in identities if role in ("client", "admin")]
    for n in names:
        if len(n) > 253 or not _SECRET_NAME.match(n):
            raise ValueError(f"Secret name {n!r} is not one Kubernetes takes (lower-case "
                             "letters, digits, - and .): change --secret-prefix or the name")
    for role, name in identities:
        stem = f"{role}-{name.replace(':', '_')}"
        if not _SECRET_KEY.match(stem):
            raise ValueError(f"{role} {name!r}: its files ({stem}.pem) cannot be keys of a "
                             "Kubernetes Secret (letters, digits, - _ . only)")


def kubernetes_secrets(directory: Path, issued: list[tuple[str, str, Path]], prefix: str,
                       namespace: str | None, labels: dict[str, str]) -> str:
    """A List of Secrets (YAML) holding the CA and the identities ``issued``: the CA's Secret
    alone holds ca.key; the others hold ca.pem and their identities' files, keyed by file
    name, so a Secret mounted as a directory is a directory of credentials files."""
    import yaml

    def secret(name: str, files: list[Path]) -> dict:
        meta = {"name": name, **({"namespace": namespace} if namespace else {}),
                **({"labels": labels} if labels else {})}
        return {"apiVersion": "v1", "kind": "Secret", "metadata": meta, "type": "Opaque",
                "data": {f.name: base64.b64encode(f.read_bytes()).decode() for f in files}}

    ca = directory / "ca.pem"
    items = [secret(f"{prefix}-ca", [ca, directory / "ca.key"])]
    # The same pair as a cert-manager CA Issuer reads it (the chart's
    # security.nodeCertificates: certManager signs each store-node pod's own certificate so).
    items[0]["data"].update({"tls.crt": items[0]["data"]["ca.pem"],
                             "tls.key": items[0]["data"]["ca.key"]})
    grouped: dict[str, list[Path]] = {}
    for role, name, creds in issued:
        group = {"master": "master", "node": "store-node"}.get(role, f"{role}-{name}")
        grouped.setdefault(group, [ca]).extend(_files(creds))
    items += [secret(f"{prefix}-{group}", files) for group, files in grouped.items()]
    return yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": items},
                          sort_keys=False)
