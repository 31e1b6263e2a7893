"""An engine stand-in for throughput benches: each request is answered as the real engine
answered the same request the first time it was seen.

Run as a script: ``python bench/replay_engine.py --port P --upstream URL``. A request not seen
before is passed to ``URL`` and its reply (status, content type, body) kept under the method,
path and body; the same request again gets that reply at once, without the engine's work.
A bench that sends one request body many times so measures the front end alone, with the
bytes a real engine sends. It prints nothing; ``GET /replay/stats`` says how many requests
were replayed and how many passed through.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

import aiohttp
from aiohttp import web


def make_app(upstream: str) -> web.Application:
    kept: dict[tuple[str, str, bytes], tuple[int, str, bytes]] = {}
    counts = {"replayed": 0, "passed": 0}
    session: dict[str, aiohttp.ClientSession] = {}

    async def stats(request: web.Request) -> web.Response:
        return web.json_response({**counts, "kept": len(kept)})

    async def answer(request: web.Request) -> web.Response:
        body = await request.read()
        key = (request.method, request.path_qs, body)
        found = kept.get(key)
        if found is not None:
            counts["replayed"] += 1
            status, content_type, reply = found
            return web.Response(status=status, body=reply, content_type=content_type)
        counts["passed"] += 1
        client = session.setdefault("client", aiohttp.ClientSession())
        headers = {"content-type": request.headers.get("content-type", "application/json")}
        async with client.request(
            request.method, upstream + request.path_qs, data=body, headers=headers
        ) as upstream_reply:
            reply = await upstream_reply.read()
            content_type = upstream_reply.content_type
            status = upstream_reply.status
        if status < 400:
            kept[key] = (status, content_type, reply)
        return web.Response(status=status, body=reply, content_type=content_type)

    async def close(app: web.Application) -> None:
        if "client" in session:
            await session["client"].close()

    app = web.Application(client_max_size=2**26)
    app.router.add_get("/replay/stats", stats)
    app.router.add_route("*", "/{path:.*}", answer)
    app.on_cleanup.append(close)
    return app


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True)
    args = parser.parse_args(argv)
    try:
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:
        pass
    web.run_app(make_app(args.upstream.rstrip("/")), host="127.0.0.1", port=args.port, print=None)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
