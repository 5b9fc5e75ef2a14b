"""A stand-in engine: an OpenAI-shaped server that answers at once, for measuring what the gateway
itself adds to a request (``scripts/bench_gateway.py --stand-in``) without an engine's own time
and noise in the figure.

    python3 scripts/stand_in_engine.py [--host H] [--port P]    # prints "stand-in: http://H:P"

``POST /v1/completions`` and ``/v1/chat/completions``: ``max_tokens`` (default 2) tokens, each a
chunk of a server-sent-event stream as vLLM writes them (``data: {...}\\n\\n``, then ``data:
[DONE]``) when ``stream`` is true, else one JSON answer. ``GET /health`` 200, ``GET /metrics``
vLLM's two queue gauges at 0 (the gateway scrapes them). Nothing is computed: the time a request
takes here is the HTTP stack's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from aiohttp import web

_METRICS = b"vllm:num_requests_running 0.0\nvllm:num_requests_waiting 0.0\n"


def _chunk(rid: str, model: str, i: int, chat: bool) -> bytes:
    choice = {"index": 0, "finish_reason": None, "logprobs": None}
    if chat:
        choice["delta"] = {"content": f" w{i + 3}"}
    else:
        choice["text"] = f" w{i + 3}"
    event = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
             "created": int(time.time()), "model": model, "choices": [choice]}
    return b"data: " + json.dumps(event).encode() + b"\n\n"


async def _complete(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    chat = request.path.endswith("/chat/completions")
    n = max(1, int(body.get("max_tokens") or 2))
    model = body.get("model") or "stand-in"
    rid = f"cmpl-{id(request):x}"
    if not body.get("stream"):
        text = "".join(f" w{i + 3}" for i in range(n))
        choice = {"index": 0, "finish_reason": "length",
                  **({"message": {"role": "assistant", "content": text}} if chat
                     else {"text": text})}
        return web.json_response({"id": rid, "object": "chat.completion" if chat
                                  else "text_completion", "model": model, "choices": [choice],
                                  "usage": {"completion_tokens": n}})
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for i in range(n):
        await response.write(_chunk(rid, model, i, chat))
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


async def _health(request: web.Request) -> web.Response:
    return web.Response()


async def _metrics(request: web.Request) -> web.Response:
    return web.Response(body=_METRICS, content_type="text/plain")


def app() -> web.Application:
    a = web.Application()
    a.router.add_post("/v1/completions", _complete)
    a.router.add_post("/v1/chat/completions", _complete)
    a.router.add_get("/health", _health)
    a.router.add_get("/metrics", _metrics)
    return a


async def serve(host: str, port: int) -> None:
    runner = web.AppRunner(app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    print(f"stand-in: http://{host}:{site._server.sockets[0].getsockname()[1]}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0: a free port (default)")
    a = p.parse_args()
    try:
        asyncio.run(serve(a.host, a.port))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
