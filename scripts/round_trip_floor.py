"""The floor of one small request and answer between two Python processes on this machine: an
echo server on uvloop (as the master's lookup port serves, without any of its work) and a
blocking client, the client either sleeping on the answer or polling for it first (as
net/sockets.py ``Spinner`` does, ``$KVPOOL_SPIN_US``). What it prints is the part of a single
get or put no change to kvpool's own code can remove: a master round trip.

    python3 scripts/round_trip_floor.py [--calls 5000] [--spin-us 0,50,200]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import socket
import statistics
import struct
import time

from kvpool.net.sockets import Spinner

_HEADER = struct.Struct("!Q")
_ANSWER = _HEADER.pack(100) + b"x" * 100


def _serve(port: multiprocessing.Queue) -> None:
    import uvloop

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                (n,) = _HEADER.unpack(await reader.readexactly(_HEADER.size))
                await reader.readexactly(n)
                writer.write(_ANSWER)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass

    async def main() -> None:
        server = await asyncio.start_server(echo, "127.0.0.1", 0)
        port.put(server.sockets[0].getsockname()[1])
        await server.serve_forever()

    uvloop.run(main())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=5000, help="round trips per figure (5000)")
    p.add_argument("--spin-us", default="0,50,200",
                   help="client poll budgets to try, microseconds (0: sleep at once)")
    args = p.parse_args()
    spawn = multiprocessing.get_context("spawn")
    port = spawn.Queue()
    server = spawn.Process(target=_serve, args=(port,), daemon=True)
    server.start()
    try:
        sock = socket.create_connection(("127.0.0.1", port.get(timeout=30)))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        request = _HEADER.pack(80) + b"y" * 80
        for spin_us in (int(s) for s in args.spin_us.split(",")):
            answer = Spinner(sock, spin_us / 1e6)
            took = []
            for _ in range(args.calls):
                start = time.perf_counter()
                sock.sendall(request)
                answer.wait()
                sock.recv(len(_ANSWER), socket.MSG_WAITALL)
                took.append(time.perf_counter() - start)
            tail = took[len(took) // 10:]   # past the warm-up
            print(f"client polls up to {spin_us:4d} us: round trip p50 "
                  f"{statistics.median(tail) * 1e6:6.1f} us, p99 "
                  f"{statistics.quantiles(tail, n=100)[98] * 1e6:6.1f} us")
        sock.close()
    finally:
        server.kill()
        server.join()


if __name__ == "__main__":
    main()
