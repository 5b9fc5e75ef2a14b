"""A real store-node data plane in its own process, for the transport contract suite.

Prints one JSON line on stdout ({node_id, boot_id, tcp_endpoint, shm_endpoint, rdma_device,
rdma_gid, rdma_port, segments: [{segment_id, size_bytes, rdma_addr, rdma_rkey}]}), then serves
until stdin closes or SIGTERM arrives, and stops cleanly (exercising DataServer.stop and
DramSegment.close). A "stats" line on stdin prints the data server's request counts as a JSON
line. Segments are registered for RDMA where a device exists (unless --no-rdma).

    python serve_node.py [--segments N] [--segment-size BYTES] [--no-shm] [--no-rdma]
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import sys


def wait_for_eof_or_signal(on_stats=None) -> None:
    # A process-directed signal may land on a server thread, which would not interrupt a plain
    # blocking read here; the wakeup fd makes the main thread's select return either way, and
    # Python then runs the handler (SystemExit) in this thread.
    r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(w)
    stdin = sys.stdin.buffer.raw
    while True:
        ready, _, _ = select.select([stdin, r], [], [])
        if stdin in ready:
            data = os.read(stdin.fileno(), 4096)
            if not data:
                return
            if b"stats" in data and on_stats is not None:
                on_stats()
        if r in ready:
            os.read(r, 4096)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--segments", type=int, default=2)
    parser.add_argument("--segment-size", type=int, default=8 << 20)
    parser.add_argument("--no-shm", action="store_true")
    parser.add_argument("--no-rdma", action="store_true")
    parser.add_argument("--log-level", default="debug")
    args = parser.parse_args()

    from kvpool.common.logging import configure
    configure(args.log_level, component="test-node")   # before any log line: stdout is ours

    from kvpool.common.host import local_boot_id
    from kvpool.store_node.data_server import DataServer
    from kvpool.store_node.memory import create_dram_segment

    def terminate(signum, frame):
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, terminate)
    segments = {}
    for index in range(args.segments):
        seg = create_dram_segment("test-node", index, args.segment_size)
        segments[seg.info.segment_id] = seg
    rdma = None
    infos = [s.info for s in segments.values()]
    if not args.no_rdma:
        from kvpool.store_node.rdma import open_node_rdma
        rdma = open_node_rdma()
        if rdma is not None:
            infos = [rdma.register(s) for s in segments.values()]
    server = DataServer(segments, shm=not args.no_shm, rdma=rdma)
    server.start()
    try:
        print(json.dumps({
            "node_id": "test-node",
            "boot_id": local_boot_id(),
            "tcp_endpoint": server.tcp_endpoint,
            "shm_endpoint": server.shm_endpoint,
            "rdma_device": rdma.device if rdma else "",
            "rdma_gid": rdma.gid if rdma else "",
            "rdma_port": rdma.port if rdma else 0,
            "segments": [{"segment_id": i.segment_id, "size_bytes": i.size_bytes,
                          "rdma_addr": i.rdma_addr, "rdma_rkey": i.rdma_rkey} for i in infos],
        }), flush=True)
        wait_for_eof_or_signal(
            lambda: print(json.dumps(server.request_counts()), flush=True))
    finally:
        server.stop()
        if rdma is not None:
            rdma.close()
        for seg in segments.values():
            seg.close()


if __name__ == "__main__":
    main()
