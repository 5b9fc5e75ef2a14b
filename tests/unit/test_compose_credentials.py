"""deploy/compose/compose.yaml runs every kvpool process with credentials: its one-shot
`credentials` service's `kvpool credentials` line, run here for real, issues into each volume
what the masters and store nodes that mount it name with --credentials, as the identity each
one is (tests/docker/test_compose.py starts the whole file in Docker)."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
import yaml
from kvpool.common import security
from kvpool.tools.cli import main

COMPOSE = Path(__file__).resolve().parents[2] / "deploy" / "compose" / "compose.yaml"
HOST = "192.0.2.10"


@pytest.fixture(scope="module")
def services() -> dict:
    return yaml.safe_load(COMPOSE.read_text())["services"]


def kvpool_services(services: dict) -> dict:
    """The services that run a kvpool process (not the one-shot that issues credentials)."""
    return {name: s for name, s in services.items()
            if "KVPOOL_IMAGE" in s.get("image", "") and name != "credentials"}


def mounts(service: dict) -> dict[str, tuple[str, bool]]:
    """target -> (volume, read-only) of a service's short-form volume mounts."""
    out = {}
    for v in service.get("volumes", []):
        if isinstance(v, str):
            source, target, *mode = v.split(":")
            out[target] = (source, mode == ["ro"])
    return out


def option(command: list[str], name: str) -> str | None:
    return command[command.index(name) + 1] if name in command else None


def test_no_kvpool_process_runs_without_credentials(services):
    kvpool = kvpool_services(services)
    assert set(kvpool) == {"master-a", "master-b", "node-1", "node-2"}
    for name, service in kvpool.items():
        command = service["command"]
        assert "--insecure" not in command, name
        path = option(command, "--credentials")
        assert path, f"{name} runs without --credentials"
        volume, read_only = mounts(service)[path.rsplit("/", 1)[0]]
        assert volume.startswith("credentials-") and read_only, (name, volume)
        # Issued before it starts, on every `up`.
        assert service["depends_on"]["credentials"] == {
            "condition": "service_completed_successfully"}
    assert all("--insecure" not in str(s.get("command", "")) for s in services.values())


def test_the_ca_volume_is_the_issuing_services_alone(services):
    users = {name for name, s in services.items()
             if any(volume == "ca" for volume, _ in mounts(s).values())}
    assert users == {"credentials"}


def test_each_process_loads_its_own_identity_from_what_the_one_shot_issues(services, tmp_path):
    issuer = services["credentials"]
    assert issuer["restart"] == "no"
    [line] = [s for s in issuer["command"][0].splitlines() if s.startswith("kvpool ")]
    argv = shlex.split(line.replace("${KVPOOL_ADVERTISE_HOST}", HOST))[1:]
    issued = {target: volume for target, (volume, _) in mounts(issuer).items()}
    [ca_dir] = [t for t, v in issued.items() if v == "ca"]
    out = option(argv, "--export")
    argv = [a.replace(ca_dir, str(tmp_path / "ca")).replace(out, str(tmp_path / "out"))
            for a in argv]
    assert main(argv) == 0
    # Each exported identity lands in exactly the volume mounted there, without the CA key.
    exported = {issued[f"{out}/{d.name}"]: d for d in (tmp_path / "out").iterdir()}
    assert not any((d / "ca.key").exists() for d in exported.values())

    for service in kvpool_services(services).values():
        command = service["command"]
        path = option(command, "--credentials")
        volume, _ = mounts(service)[path.rsplit("/", 1)[0]]
        creds = security.load(exported[volume] / path.rsplit("/", 1)[1])
        if command[0] == "master":
            assert creds.identity == security.Identity("master", "master")
        else:
            assert creds.identity == security.Identity("node", option(command, "--node-id"))
    client = security.load(exported["credentials-client"] / "client-default.yaml")
    assert client.identity == security.Identity("client", "default")

    from cryptography import x509
    master = x509.load_pem_x509_certificate(
        (exported["credentials-master"] / "master-master.pem").read_bytes())
    san = master.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(a) for a in san.get_values_for_type(x509.IPAddress)] == [HOST]
