"""deploy/compose/compose.yaml, started for real (Compose v2 through testcontainers'
DockerCompose): the one-shot credentials service, etcd, two masters of which one leads, two
store nodes; a client on this host, with the client credentials copied out of the stack, puts
and reads back through it; `down -v` leaves nothing behind. The monitoring profile's images
(Prometheus, Grafana) cannot be pulled here: that profile is checked with `config` only."""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest
from kvpool.client import KVClient

from .conftest import REPO, http_get, samples, wait_for

pytestmark = [pytest.mark.docker, pytest.mark.timeout(1200)]   # a cold build may come first

COMPOSE_DIR = REPO / "deploy" / "compose"
MASTERS = {"master-a": (50051, 9400), "master-b": (50053, 9410)}   # gRPC port, metrics port
NODES = {"node-1": 9401, "node-2": 9411}                            # metrics port


@pytest.fixture
def compose_env(docker_daemon, compose_config, tmp_path, monkeypatch):
    """The env file a user would export: this host's address (the namespace's here), and the
    etcd image built here in place of quay.io's."""
    monkeypatch.setenv("DOCKER_CONFIG", compose_config)
    env_file = tmp_path / "compose.env"
    env_file.write_text(f"KVPOOL_ADVERTISE_HOST={docker_daemon.ns_ip}\n"
                        f"KVPOOL_IMAGE={docker_daemon.image}\n"
                        f"KVPOOL_ETCD_IMAGE={docker_daemon.etcd_image}\n"
                        "KVPOOL_SEGMENT_SIZE=64MiB\nKVPOOL_DISK_SIZE=64MiB\n")
    return env_file


def compose(docker_daemon, env_file, *args: str) -> subprocess.CompletedProcess:
    return docker_daemon.run("compose", "-f", str(COMPOSE_DIR / "compose.yaml"),
                             "--env-file", str(env_file), *args)


def test_compose_serves_a_host_client_and_goes_away_with_down(docker_daemon, compose_env,
                                                              tmp_path):
    from testcontainers.compose import DockerCompose

    ip = docker_daemon.ns_ip
    stack = DockerCompose(COMPOSE_DIR, compose_file_name="compose.yaml", env_file=str(compose_env),
                          docker_command_path=docker_daemon.docker)
    with stack:
        # The one-shot credentials service has exited (successfully: the others started).
        running = {c.Service for c in stack.get_containers()} - {"credentials"}
        assert running == {"etcd", *MASTERS, *NODES}
        leaders = wait_for(lambda: _leaders(ip), 60, "a master to lead")
        assert len(leaders) == 1, leaders
        leader = leaders[0]
        wait_for(lambda: _metric(ip, MASTERS[leader][1], "kvpool_master_nodes") == 2, 60,
                 "both store nodes to mount")
        values = {f"c{i}": np.random.default_rng(i).bytes(50_000 + i) for i in range(10)}
        masters = ",".join(f"{ip}:{port}" for port, _ in MASTERS.values())
        # Secure by default: without the client's credentials the masters refuse the client.
        compose(docker_daemon, compose_env, "cp", "credentials:/out/client-default",
                str(tmp_path / "client"))
        with KVClient(masters, credentials=str(tmp_path / "client" / "client-default.yaml")) as kv:
            for key, v in values.items():
                kv.put(key, v)
            assert kv.batch_get(list(values), verify=True) == list(values.values())
            assert kv.master_address == f"{ip}:{MASTERS[leader][0]}"
        assert _metric(ip, MASTERS[leader][1], 'kvpool_master_objects{state="complete"}') == 10
        assert http_get(f"http://{ip}:{MASTERS[leader][1]}/readyz")[0] == 200
        standby = next(m for m in MASTERS if m != leader)
        assert http_get(f"http://{ip}:{MASTERS[standby][1]}/readyz")[0] == 503   # not leading
        for name, port in NODES.items():
            assert _metric(ip, port, f'kvpool_node_ready{{node="{name}"}}') == 1
            assert http_get(f"http://{ip}:{port}/readyz") == (200, "ready\n")
    # `down --volumes` (DockerCompose's exit): no container, network or volume of the project.
    project = ["--filter", "label=com.docker.compose.project=kvpool", "-q"]
    assert docker_daemon.run("ps", "-a", *project).stdout.split() == []
    assert docker_daemon.run("network", "ls", *project).stdout.split() == []
    assert docker_daemon.run("volume", "ls", *project).stdout.split() == []


def test_the_monitoring_profile_is_prometheus_and_grafana_on_the_shared_files(docker_daemon,
                                                                              compose_env):
    config = json.loads(compose(docker_daemon, compose_env, "--profile", "monitoring", "config",
                                "--format", "json").stdout)
    services = config["services"]
    assert set(services) == {"credentials", "etcd", *MASTERS, *NODES, "prometheus", "grafana"}
    mounts = {(m["source"], m["target"]) for s in ("prometheus", "grafana")
              for m in services[s]["volumes"]}
    deploy = REPO / "deploy"
    assert mounts == {
        (str(COMPOSE_DIR / "prometheus.yml"), "/etc/prometheus/prometheus.yml"),
        (str(deploy / "prometheus/kvpool-alerts.yml"), "/etc/prometheus/kvpool-alerts.yml"),
        (str(deploy / "grafana/provisioning/datasources/kvpool.yaml"),
         "/etc/grafana/provisioning/datasources/kvpool.yaml"),
        (str(deploy / "grafana/provisioning/dashboards/kvpool.yaml"),
         "/etc/grafana/provisioning/dashboards/kvpool.yaml"),
        (str(deploy / "grafana/kvpool-dashboard.json"),
         "/var/lib/grafana/dashboards/kvpool-dashboard.json")}
    # Without the profile, `up` starts neither.
    plain = compose(docker_daemon, compose_env, "config", "--services").stdout.split()
    assert set(plain) == {"credentials", "etcd", *MASTERS, *NODES}


def _metric(ip: str, port: int, name: str) -> float | None:
    status, text = http_get(f"http://{ip}:{port}/metrics")
    return samples(text).get(name) if status == 200 else None


def _leaders(ip: str) -> list[str]:
    """The masters whose metrics say they lead; [] until every master answers."""
    seen = {m: _metric(ip, port, "kvpool_master_leader") for m, (_, port) in MASTERS.items()}
    if None in seen.values():
        return []
    return [m for m, v in seen.items() if v == 1]
