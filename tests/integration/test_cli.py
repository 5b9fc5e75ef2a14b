"""The command line as a user runs it: real processes, real signals."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
from kvpool.client import KVClient, ObjectNotFound
from kvpool.tools.cli import COMMANDS

KVPOOL = [sys.executable, "-m", "kvpool"]


def kvpool(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([*KVPOOL, *args], capture_output=True, text=True, timeout=timeout,
                          check=False)


@pytest.mark.parametrize("args, message", [
    (["store-node", "--master", "127.0.0.1:1", "--segment-size", "4Gx"], "invalid size '4Gx'"),
    (["store-node", "--master", "127.0.0.1:1", "--segment-size", "0"], "greater than zero"),
    (["master", "--node-ttl", "ten"], "invalid duration 'ten'"),
    (["master", "--high-watermark", "1.5"], "invalid fraction"),
    (["master", "--port", "70000"], "invalid port"),
    (["up", "--nodes", "0"], "invalid count"),
])
def test_bad_flags_are_explained(args, message):
    r = kvpool(*args)
    assert r.returncode == 2
    assert message in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("cmd", list(COMMANDS))
def test_every_flag_has_help(cmd):
    r = kvpool(cmd, "--help")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"usage: kvpool {cmd} ")
    lines = r.stdout.split("options:")[1]
    assert "--" in lines and "None" not in lines


def test_the_command_list_names_every_command():
    r = kvpool("--help")
    assert r.returncode == 0
    for cmd, (summary, _) in COMMANDS.items():
        assert cmd in r.stdout and summary in " ".join(r.stdout.split())
    r = kvpool("nonsense")
    assert r.returncode == 2 and "invalid choice: 'nonsense'" in r.stderr


# What help must not pay for: the heavy commands' code and the optional heavy dependencies.
HEAVY_MODULES = re.compile(r"kvpool\.tools\.(bench|soak|replay)\w*|kvpool\.gateway(\..*)?"
                           r"|(torch|matplotlib|numpy|aiohttp|transformers)(\..*)?")


@pytest.mark.parametrize("args", [["--help"], ["master", "--help"], ["gateway", "--help"]])
def test_help_imports_no_command_it_does_not_show(args):
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "kvpool", *args],
                       capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 0, r.stderr
    imported = [line.rsplit("|", 1)[1].strip() for line in r.stderr.splitlines()
                if line.startswith("import time:") and "|" in line]
    assert "kvpool.tools.cli" in imported     # the report is read right
    assert [m for m in imported if HEAVY_MODULES.fullmatch(m)] == []


def test_unreachable_master_is_a_clear_error():
    r = kvpool("stat", "--master", "127.0.0.1:1", timeout=30)
    assert r.returncode == 1
    assert "master 127.0.0.1:1" in r.stderr and "Traceback" not in r.stderr
    r = kvpool("stat", "--master", "nonsense")
    assert r.returncode == 1 and "invalid master address" in r.stderr


def test_a_taken_lookup_port_is_a_clear_error():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = kvpool("master", "--port", "0", "--lookup-port", str(port))
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert f"cannot listen on 127.0.0.1:{port} for lookups" in r.stderr


def test_bad_config_file(tmp_path):
    cfg = tmp_path / "m.yaml"
    cfg.write_text("put_timeout_s: 5s\nbogus: 1\n")
    r = kvpool("master", "--port", "0", "--config", str(cfg))
    assert r.returncode == 1 and "unknown settings" in r.stderr and "bogus" in r.stderr


def test_up_stat_and_clean_ctrl_c(tmp_path):
    up = subprocess.Popen([*KVPOOL, "up", "--segment-size", "64MiB"], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
    try:
        line = up.stdout.readline()
        assert line.startswith("master: 127.0.0.1:"), line
        master = line.split()[1]
        with KVClient(master) as kv:
            kv.put("hello", b"world")
            assert kv.get("hello") == b"world"
            with pytest.raises(ObjectNotFound):
                kv.get("absent")
        stat = kvpool("stat", "--master", master)
        assert stat.returncode == 0, stat.stderr
        assert "2 nodes, 2 segments" in stat.stdout
        assert "objects 1" in stat.stdout and "hits 1, misses 1" in stat.stdout
        figures = json.loads(kvpool("stat", "--master", master, "--json").stdout)
        assert (figures["nodes"], figures["objects"], figures["hits"], figures["misses"]) \
            == (2, 1, 1, 1)
        assert [g["size_bytes"] for g in figures["segments"]] == [64 << 20] * 2
        assert sum(g["objects"] for g in figures["segments"]) == 1
        assert (figures["committed"], figures["committed_bytes"], figures["hit_bytes"]) \
            == (1, 5, 5)
        top = kvpool("top", "--master", master, "--count", "2", "--interval", "0.1s")
        assert top.returncode == 0, top.stderr
        assert top.stdout.count("kvpool top  master") == 2   # not a terminal: one after another
        assert "nodes 2  segments 2  objects 1" in top.stdout and "\x1b[" not in top.stdout
        assert "gets 0 keys/s (0 B/s)" in top.stdout        # the second view has rates
        up.send_signal(signal.SIGINT)
        assert up.wait(30) == 0
    finally:
        up.kill()
        up.wait()
    time.sleep(0.2)
    # Nothing is left running: the master's port no longer answers.
    r = kvpool("stat", "--master", master, timeout=30)
    assert r.returncode == 1


def test_up_with_a_disk_tier_per_node(tmp_path):
    """``kvpool up --disk-size``: each node gets a disk tier (DIR/NODE with --disk-path, kept
    after exit; a temporary directory otherwise, removed on exit)."""
    assert "--disk-path needs --disk-size" in kvpool("up", "--disk-path", str(tmp_path)).stderr
    (tmp_path / "file").write_text("")
    bad = kvpool("up", "--disk-size", "16MiB", "--disk-path", str(tmp_path / "file"))
    assert bad.returncode == 1 and "kvpool up: error:" in bad.stderr, bad.stderr
    assert "Traceback" not in bad.stderr
    for keep in (True, False):
        extra = ["--disk-path", str(tmp_path / "disks")] if keep else []
        up = subprocess.Popen([*KVPOOL, "up", "--nodes", "1", "--segment-size", "8MiB",
                               "--disk-size", "16MiB", *extra], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
        try:
            master = up.stdout.readline().split()[1]
            banner = up.stdout.readline()
            assert "MiB disk tier in " in banner, banner
            where = banner.split("disk tier in ")[1].split(". Try:")[0]
            stat = kvpool("stat", "--master", master)
            assert stat.returncode == 0, stat.stderr
            rows = [line.split() for line in stat.stdout.splitlines()
                    if line.startswith("node0 ")]
            assert {r[1] for r in rows} >= {"dram", "disk"}, stat.stdout
            assert (where == str(tmp_path / "disks")) == keep
            assert os.path.isdir(os.path.join(where, "node0"))
            up.send_signal(signal.SIGINT)
            assert up.wait(30) == 0
        finally:
            up.kill()
            up.wait()
        assert os.path.isdir(where) == keep, where


@pytest.mark.slow
def test_demo_small():
    r = kvpool("demo", "--instances", "2", "--requests", "3", "--prefix-tokens", "128",
               "--block-bytes", "64KiB", timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "wrong blocks            0" in r.stdout
    saved = int(r.stdout.split("prefill tokens saved")[1].split()[0])
    assert saved > 0            # shared prefixes were served from the pool
    assert "local cluster stopped" in r.stdout


def test_segment_larger_than_memory_is_refused():
    r = kvpool("store-node", "--master", "127.0.0.1:1", "--segment-size", "64TiB")
    assert r.returncode == 1
    assert "do not fit" in r.stderr and "Traceback" not in r.stderr


def test_hugepages_without_enough_reserved_pages_is_refused():
    from kvpool.common.errors import InvalidArgument
    from kvpool.store_node.memory import check_hugepages
    try:
        check_hugepages([64 << 20])
    except InvalidArgument:
        pass
    else:
        pytest.skip("this host has 32 free huge pages: nothing to refuse")
    r = kvpool("store-node", "--master", "127.0.0.1:1", "--segment-size", "64MiB",
               "--hugepages")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "--hugepages:" in r.stderr and "sysctl vm.nr_hugepages=" in r.stderr, r.stderr
