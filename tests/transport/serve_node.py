"""A real store-node data plane in its own process, for the transport contract suite.

Prints one JSON line on stdout ({node_id, boot_id, tcp_endpoint, shm_endpoint, segments:
[{segment_id, size_bytes}]}), then serves until stdin closes or SIGTERM arrives, and stops
cleanly (exercising DataServer.stop and DramSegment.close).

    python serve_node.py [--segments N] [--segment-size BYTES] [--no-shm]
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import sys


def wait_for_eof_or_signal() -> None:
    # A process-directed signal may land on a server thread, which would not interrupt a plain
    # blocking read here; the wakeup fd makes the main thread's select return either way, and
    # Python then runs the handler (SystemExit) in this thread.
    r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(w)
    stdin = sys.stdin.buffer.raw
    while True:
        ready, _, _ = select.select([stdin, r], [], [])
        if stdin in ready and not os.read(stdin.fileno(), 4096):
            return
        if r in ready:
            os.read(r, 4096)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--segments", type=int, default=2)
    parser.add_argument("--segment-size", type=int, default=8 << 20)
    parser.add_argument("--no-shm", action="store_true")
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
    server = DataServer(segments, shm=not args.no_shm)
    server.start()
    try:
        print(json.dumps({
            "node_id": "test-node",
            "boot_id": local_boot_id(),
            "tcp_endpoint": server.tcp_endpoint,
            "shm_endpoint": server.shm_endpoint,
            "segments": [{"segment_id": s.info.segment_id, "size_bytes": s.info.size_bytes}
                         for s in segments.values()],
        }), flush=True)
        wait_for_eof_or_signal()
    finally:
        server.stop()
        for seg in segments.values():
            seg.close()


if __name__ == "__main__":
    main()
