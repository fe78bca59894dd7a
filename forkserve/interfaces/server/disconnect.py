"""Notice a client that goes away while a non-streamed response is being computed.

Starlette cancels a streaming response when its client disconnects, but lets a plain
handler run to the end; a long generation would then hold its pages for nobody. So the
handler awaits its result while polling the connection, and a disconnect raises
``ClientDisconnected`` (answered 499, the "client closed request" of nginx, which no
client will read), letting the handler's cleanup abort what is still running.
"""
from __future__ import annotations

import asyncio
from typing import Awaitable, TypeVar

from fastapi import Request

T = TypeVar("T")

_POLL_S = 0.25


class ClientDisconnected(Exception):
    http_status = 499


async def unless_disconnected(request: Request, awaitable: Awaitable[T]) -> T:
    task = asyncio.ensure_future(awaitable)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientDisconnected("the client closed the connection")
    finally:
        if not task.done():
            task.cancel()
            task.add_done_callback(_consume)


def _consume(task: asyncio.Future) -> None:
    """Mark the cancelled task's outcome as seen (asyncio would log it as never retrieved)."""
    if not task.cancelled():
        task.exception()
