"""Merging several async streams (the ``n`` choices of one request) into one."""
from __future__ import annotations

import asyncio
from typing import AsyncIterator, Awaitable, Callable, Sequence, TypeVar

T = TypeVar("T")


async def merge_tagged(sources: Sequence[AsyncIterator[T]],
                       on_end: Callable[[int], Awaitable[None]] | None = None
                       ) -> AsyncIterator[tuple[int, T]]:
    """``(index, item)`` from every source as items arrive. ``on_end(i)`` runs when source
    ``i`` stops, however it stops; the first error a source raises reaches the consumer, and
    leaving early (a client gone) cancels every source."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, source: AsyncIterator[T]) -> None:
        try:
            async for item in source:
                queue.put_nowait((i, item))
        except Exception as exc:  # noqa: BLE001 - re-raised to the consumer below
            queue.put_nowait(exc)
        finally:
            if on_end is not None:
                await on_end(i)
            queue.put_nowait(None)

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(sources)]
    try:
        done = 0
        while done < len(tasks):
            item = await queue.get()
            if item is None:
                done += 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
