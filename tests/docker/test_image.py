"""kvpool's image as deploy/docker/Dockerfile promises it: `kvpool` as the entrypoint, an
unprivileged user, no compiler and no torch inside, SIGINT to stop (a `docker stop` that takes
seconds, not the 10 s SIGKILL timeout)."""

from __future__ import annotations

import json
import time

import pytest

pytestmark = [pytest.mark.docker, pytest.mark.timeout(1200)]   # a cold build is in the first

# Keeps what does not belong in the image out of it (torch alone is ~700 MB); measured with the
# debootstrap base: 283 MB.
MAX_IMAGE_BYTES = 350_000_000


def test_the_image_runs_kvpool_as_an_unprivileged_user(docker_daemon):
    d = docker_daemon
    config = json.loads(d.run("image", "inspect", d.image).stdout)[0]["Config"]
    assert config["Entrypoint"] == ["kvpool"]
    assert config["User"] == "10001:10001"
    assert config["StopSignal"] == "SIGINT"
    assert set(config["ExposedPorts"]) == {"50051/tcp", "50052/tcp", "9400/tcp", "50060/tcp",
                                           "9401/tcp"}
    assert "cluster-wide KV-cache store" in d.run("run", "--rm", d.image).stdout   # CMD --help
    inside = d.run("run", "--rm", "--entrypoint", "sh", d.image, "-c",
                   "id -u; id -g; for c in gcc cc c++ g++ clang make ld; do command -v $c; done;"
                   " python -c 'import torch' 2>&1 | tail -n 1").stdout.splitlines()
    assert inside == ["10001", "10001", "ModuleNotFoundError: No module named 'torch'"]
    size = int(d.run("image", "inspect", "-f", "{{.Size}}", d.image).stdout)
    print(f"{d.image}: {size} bytes")
    assert size < MAX_IMAGE_BYTES


def test_docker_stop_ends_a_master_at_once(docker_daemon):
    d = docker_daemon
    name = "kvptest-stop"
    d.run("run", "-d", "--name", name, d.image, "master", "--host", "0.0.0.0", "--insecure")
    try:
        # Stopped once it serves, not while Python is still importing.
        deadline = time.monotonic() + 30
        while "master: " not in d.run("logs", name).stdout:
            assert time.monotonic() < deadline, d.run("logs", name).stderr
            time.sleep(0.2)
        started = time.monotonic()
        d.run("stop", "-t", "20", name)
        took = time.monotonic() - started
        state = json.loads(d.run("inspect", name).stdout)[0]["State"]
        assert state["ExitCode"] == 0, d.run("logs", name).stderr
        assert took < 5, f"docker stop took {took:.1f} s"
    finally:
        d.run("rm", "-f", name, check=False)
