"""Server-sent events: the ``n`` choices of one request streamed as one event stream, in OpenAI's
chunk format (``data: {...}`` lines, ``data: [DONE]`` at the end)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable

from fastapi.responses import StreamingResponse

from h2okv.serve.errors import ServeError
from h2okv.serve.types import Event, Handle

# (choice index, event, first chunk of that choice, finish_reason or None) -> a chunk, or None: nothing to send
ChunkMaker = Callable[[int, Event, bool, "str | None"], "dict | None"]


async def merged(handles: list[Handle]) -> AsyncIterator[tuple[int, Event]]:
    """The events of all ``handles`` as they come, each with its choice index."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, handle: Handle) -> None:
        while True:
            event = await handle.next()
            await queue.put((index, event))
            if event.final:
                return

    pumps = [asyncio.create_task(pump(i, h)) for i, h in enumerate(handles)]
    try:  # ends: every handle ends with one final event, which ends its pump
        while not (all(p.done() for p in pumps) and queue.empty()):
            yield await queue.get()
    finally:
        for p in pumps:
            p.cancel()


def sse_response(handles: list[Handle], make_chunk: ChunkMaker, usage_chunk: Callable[[list[Event]], dict],
                 include_usage: bool, error_body: Callable[[ServeError], dict]) -> StreamingResponse:
    """Server-sent events of all choices, interleaved as their tokens come; each choice ends with
    its ``finish_reason`` chunk, then (``include_usage``) one usage chunk, then ``[DONE]``. A failed
    choice ends the stream with ``error_body`` of its error."""

    def data(obj) -> str:
        if include_usage and "choices" in obj and "usage" not in obj:
            obj["usage"] = None
        return f"data: {json.dumps(obj)}\n\n"

    async def events() -> AsyncIterator[str]:
        first = [True] * len(handles)
        dones: list[Event] = []
        try:
            async for index, event in merged(handles):
                if event.kind == "error":
                    yield data(error_body(event.error))
                    return
                if event.kind == "cancelled":
                    return
                piece = make_chunk(index, event, first[index], None)
                if piece is not None:
                    yield data(piece)
                    first[index] = False
                if event.kind == "done":  # the last text (with its logprobs), then finish_reason alone
                    first[index] = False
                    yield data(make_chunk(index, Event("text"), False, event.finish_reason))
                    dones.append(event)
            if include_usage and dones:
                yield data(usage_chunk(dones))
            yield "data: [DONE]\n\n"
        finally:  # normal end, client gone (generator closed or cancelled): free the slots
            for handle in handles:
                handle.cancel()

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
