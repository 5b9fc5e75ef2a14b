"""``kvpool bench --disk-tier``: the disk tier beside a plain sequential read of the same bytes.

On a local cluster with one store node that has a DRAM segment and a disk tier (in a temporary
directory, or ``--disk-dir``): fill DRAM past its high watermark and time the demotions it makes
(node copies DRAM -> disk, master switches the index); then read the demoted objects back through
the client (tcp from the node), cold (the disk file's pages dropped from the page cache first)
and warm, and read the same bytes from a plain file with sequential 8 MiB reads, cold and warm,
in the same run. Dropping pages needs no root: ``fsync`` + ``posix_fadvise(DONTNEED)``.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from kvpool.common.config import format_size

_CHUNK = 8 << 20


def _drop_cache(path: Path) -> None:
    """Write back, then drop from the page cache, the pages of ``path`` not mapped by anyone."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _file_read_s(path: Path, total: int, buf: bytearray) -> float:
    view = memoryview(buf)
    start = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        done = 0
        while done < total:
            n = f.readinto(view[:min(_CHUNK, total - done)])
            if not n:
                raise OSError(f"{path} is shorter than {total} bytes")
            done += n
    return time.perf_counter() - start


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def run_disk_bench(total_bytes: int = 256 << 20, block_bytes: int = 2 << 20, repeats: int = 3,
                   disk_dir: str | None = None, json_path: str | None = None) -> dict:
    """Run the disk-tier figures; print a table; return the figures."""
    from kvpool.client import KVClient
    from kvpool.tools.cluster import LocalCluster

    n = max(4, total_bytes // block_bytes)
    total = n * block_bytes
    # DRAM holds all of it just below 100%: above the 0.75 high watermark, so the master
    # demotes down to the 0.5 low watermark, about half of it.
    dram = int(total / 0.98) // 4096 * 4096 + 4096
    with tempfile.TemporaryDirectory(prefix="kvpool-bench-disk-", dir=disk_dir) as tmp:
        tmp_path = Path(tmp)
        cluster = LocalCluster(
            nodes=0, segment_size=str(dram), log_dir=tmp_path / "logs",
            master_args=["--high-watermark", "0.75", "--low-watermark", "0.5",
                         "--promote-window", "1ms", "--lease-ttl", "1s"],
            node_args=["--heartbeat-interval", "100ms", "--scrub-rate", "0"])
        with cluster:
            cluster.add_node("disk0", ["--disk-path", str(tmp_path / "disk"),
                                       "--disk-size", str(2 * total)])
            rng = np.random.default_rng(0)
            values = [rng.integers(0, 256, block_bytes, dtype=np.uint8) for _ in range(n)]
            keys = [f"bench-disk-{i}" for i in range(n)]
            with KVClient(cluster.master, transports=["tcp"]) as kv:
                print(f"disk tier: putting {n} x {format_size(block_bytes)} into a "
                      f"{format_size(dram)} DRAM segment ...", flush=True)
                errors = kv.batch_put(keys, values)
                if any(errors):
                    raise RuntimeError(f"put failed: {next(e for e in errors if e)}")
                # Demotion: from the put's end until the demotions stop (DRAM under its low
                # watermark), by the master's counter.
                start = time.perf_counter()
                last, last_change = -1, start
                while time.perf_counter() - last_change < 1.0:
                    d = kv.stats().demotions
                    if d != last:
                        last, last_change = d, time.perf_counter()
                    time.sleep(0.01)
                demoted_s = last_change - start
                views = kv._master.locate(keys).views()
                on_disk = [k for k, v in zip(keys, views) if v.replicas[0].tier == "disk"]
                if not on_disk:
                    raise RuntimeError("nothing was demoted to the disk tier")
                disk_bytes = len(on_disk) * block_bytes
                time.sleep(1.2)   # the leases of that lookup end: no read is in flight
                bufs = [np.empty(block_bytes, np.uint8) for _ in on_disk]
                data_file = tmp_path / "disk" / "kvpool-disk.data"
                # The same bytes in a plain file, for the sequential-read baseline.
                plain = tmp_path / "plain.bin"
                with open(plain, "wb") as f:
                    f.writelines(values[keys.index(k)].data for k in on_disk)
                scratch = bytearray(_CHUNK)
                figures: dict[str, list[float]] = {"kvpool_cold": [], "kvpool_warm": [],
                                                   "file_cold": [], "file_warm": []}
                for _ in range(repeats):
                    _drop_cache(data_file)
                    t = time.perf_counter()
                    got = kv.batch_get_into(on_disk, bufs)
                    figures["kvpool_cold"].append(time.perf_counter() - t)
                    if any(not isinstance(g, int) for g in got):
                        raise RuntimeError(f"read failed: {got}")
                    t = time.perf_counter()
                    kv.batch_get_into(on_disk, bufs)
                    figures["kvpool_warm"].append(time.perf_counter() - t)
                    _drop_cache(plain)
                    figures["file_cold"].append(_file_read_s(plain, disk_bytes, scratch))
                    figures["file_warm"].append(_file_read_s(plain, disk_bytes, scratch))
                ok = all((b == values[keys.index(k)]).all() for k, b in zip(on_disk, bufs))
    result = {
        "block_bytes": block_bytes, "objects_on_disk": len(on_disk), "disk_bytes": disk_bytes,
        "demoted_objects": last, "demotion_gbps": _gbps(last * block_bytes, demoted_s),
        "bytes_identical": ok,
        **{f"{name}_gbps": _gbps(disk_bytes, statistics.median(v))
           for name, v in figures.items()},
    }
    result["cold_ratio_vs_file"] = result["kvpool_cold_gbps"] / result["file_cold_gbps"]
    result["warm_ratio_vs_file"] = result["kvpool_warm_gbps"] / result["file_warm_gbps"]
    print(f"\ndisk tier ({len(on_disk)} x {format_size(block_bytes)} = "
          f"{format_size(disk_bytes)} on disk; median of {repeats})")
    print(f"  demotion DRAM -> disk   {result['demotion_gbps']:6.2f} GB/s "
          f"({last} objects, tick + heartbeat + copy + index switch)")
    print(f"  {'':24}{'kvpool (tcp)':>14} {'plain file':>12} {'ratio':>7}")
    for kind in ("cold", "warm"):
        print(f"  read, {kind:<4} page cache   {result[f'kvpool_{kind}_gbps']:10.2f} GB/s "
              f"{result[f'file_{kind}_gbps']:7.2f} GB/s {result[f'{kind}_ratio_vs_file']:6.2f}x")
    print(f"  bytes identical: {ok}")
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=2))
    return result
