"""Whether the harness hung up: one look at the ASGI receive channel, or a wait for it.

Starlette's ``Request.is_disconnected`` opens and cancels an anyio cancel scope to poll the
channel, about 0.5 ms of CPU a call at the front end's rate. Here the poll is one task that
either finds the disconnect already queued or is cancelled after one turn of the loop.
"""

from __future__ import annotations

import asyncio

from starlette.requests import Request


async def client_gone(request: Request) -> bool:
    """True when the server already saw the client disconnect; never waits for one."""
    poll = asyncio.ensure_future(request.receive())
    await asyncio.sleep(0)  # one turn: a disconnect that is already there is delivered
    if not poll.done():
        poll.cancel()
        return False
    if poll.cancelled() or poll.exception() is not None:
        return True  # the channel is closed: nobody is reading the reply
    return poll.result().get("type") == "http.disconnect"


async def disconnected(request: Request) -> None:
    """Returns once the harness closed its connection."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
