"""The engine requests behind one HTTP request: started together, read as one stream, and
cancelled (so aborted, their blocks freed) when the client goes away."""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Awaitable

from fastapi import Request

from kvstrata.cluster.engine_service import EngineService, StreamItem
from kvstrata.worker.sampling_params import SamplingParams


class ClientGone(Exception):
    """The client disconnected before its response was ready."""


class Runs:
    """The engine requests of one HTTP request, one per prompt. `start` submits them together and
    waits for each one's first output, so bad input, overload or drain is known before any byte of
    the response is sent."""

    def __init__(self, started: list[tuple[AsyncIterator[StreamItem], StreamItem]]):
        self.started = started

    @property
    def workers(self) -> list[str]:
        """In a cluster, the workers serving these requests (known from each one's first output)."""
        return sorted({first.worker for _, first in self.started if first.worker})

    @classmethod
    async def start(cls, service: EngineService, prompts: list[tuple[list[int], str | None]],
                    params: SamplingParams, cache_salt: str, request_id: str,
                    cache_pins: list[tuple[int, float]] | None = None, tenant: str = "") -> Runs:
        gens = [service.generate(ids, params, request_id=f"{request_id}-{k}", cache_salt=cache_salt, prompt=text,
                                 cache_pins=cache_pins, tenant=tenant)
                for k, (ids, text) in enumerate(prompts)]
        firsts = await asyncio.gather(*(g.__anext__() for g in gens), return_exceptions=True)
        failed = next((f for f in firsts if isinstance(f, BaseException)), None)
        if failed is not None:
            for g in gens:
                await g.aclose()
            raise failed
        return cls(list(zip(gens, firsts)))

    async def items(self) -> AsyncIterator[tuple[int, StreamItem]]:
        """(prompt index, item) as they come, from every prompt's stream."""
        if len(self.started) == 1:
            gen, first = self.started[0]
            try:
                yield 0, first
                async for item in gen:
                    yield 0, item
            finally:
                await gen.aclose()
            return
        q: asyncio.Queue = asyncio.Queue()

        async def pump(k: int, gen: AsyncIterator[StreamItem], first: StreamItem) -> None:
            try:
                q.put_nowait((k, first))
                async for item in gen:
                    q.put_nowait((k, item))
                q.put_nowait((k, None))
            except Exception as e:  # handed to the consumer
                q.put_nowait((k, e))

        tasks = [asyncio.create_task(pump(k, g, f)) for k, (g, f) in enumerate(self.started)]
        try:
            remaining = len(tasks)
            while remaining:
                k, item = await q.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield k, item
        finally:
            for t in tasks:
                t.cancel()

    async def aclose(self) -> None:
        for gen, _ in self.started:
            await gen.aclose()


async def unless_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """Await work, cancelling it (and so aborting its engine requests) if the client goes away."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.05)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientGone()
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
