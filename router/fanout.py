"""A batched /v1/completions request served as one ordinary request per prompt, all at once (each its own P/D
pair, pairing id, retry and deadline: `Dispatcher.handle`), the answers merged by router/batch.py.

A prompt that fails before the client got anything fails the whole request with its error, and every other
prompt's legs are closed (vLLM fails a batch the same way). A stream that breaks after the 200 is sent ends with
that prompt's in-band error event, every other stream closed, then one `[DONE]`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from router import batch, protocol
from router.answer import JsonAnswer, StreamAnswer
from router.dispatch import ClientRequest, Dispatcher
from router.domain import Endpoint
from router.sse import EventFramer, error_of


class BatchStream:
    """The prompts' streams relayed as one, in the order their events come; owns every prompt's stream."""

    def __init__(self, streams: Sequence[StreamAnswer], n: int, max_event_bytes: int) -> None:
        self._streams = streams
        self._merge = batch.StreamMerge(len(streams), n)
        self._framers = [EventFramer(max_event_bytes) for _ in streams]
        self._stalled = False

    @property
    def stalled(self) -> bool:
        return self._stalled or any(s.stalled for s in self._streams)

    async def relay(self, send: Callable[[bytes], Awaitable[None]], *, idle: float, write_stall: float) -> None:
        """Each prompt's stream relayed under its own idle bound into one queue; merged events to `send`."""
        queue: asyncio.Queue[tuple[int, bytes | None]] = asyncio.Queue()

        async def pump(index: int, stream: StreamAnswer) -> None:
            async def put(chunk: bytes) -> None:
                queue.put_nowait((index, chunk))

            try:
                await stream.relay(put, idle=idle, write_stall=write_stall)
            finally:
                queue.put_nowait((index, None))

        pumps = [asyncio.create_task(pump(i, s)) for i, s in enumerate(self._streams)]
        try:
            await self._merged(queue, len(pumps), send, write_stall)
        except TimeoutError:
            self._stalled = True  # the client took nothing for write_stall s
        finally:
            for task in pumps:
                task.cancel()
            await asyncio.wait(pumps)

    async def _merged(
        self,
        queue: asyncio.Queue[tuple[int, bytes | None]],
        running: int,
        send: Callable[[bytes], Awaitable[None]],
        write_stall: float,
    ) -> None:
        broke = False
        while running and not broke:
            index, chunk = await queue.get()
            if chunk is None:
                running -= 1
                events = [rest] if (rest := self._framers[index].flush()) else []
            else:
                events = self._framers[index].feed(chunk)
            out = b"".join(self._merge.event(index, event) for event in events)
            broke = any(error_of(event) is not None for event in events)
            if out:
                async with asyncio.timeout(write_stall):
                    await send(out)
        async with asyncio.timeout(write_stall):
            await send(batch.DONE if broke else self._merge.end())

    async def aclose(self) -> None:
        for stream in self._streams:
            await asyncio.shield(stream.aclose())


async def handle_batch(
    dispatcher: Dispatcher, request: ClientRequest, prompts: Sequence[Any], max_event_bytes: int
) -> JsonAnswer | BatchStream:
    """Every prompt at once; the merged answer, or the first prompt's error (the others closed)."""
    subs = [_sub(dispatcher, request, i, prompt) for i, prompt in enumerate(prompts)]
    tasks = [asyncio.create_task(dispatcher.handle(sub)) for sub in subs]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in tasks:
            if task.done() and (error := task.exception()) is not None:
                raise error
    except BaseException:
        await _close_all(tasks)
        raise
    finally:
        request.record.pairing_id = ",".join(sub.record.pairing_id or "" for sub in subs)
    answers = [task.result() for task in tasks]
    n = protocol.choices(request.body)
    if not request.info.stream:
        return JsonAnswer(200, batch.merge_json([a.content for a in answers if isinstance(a, JsonAnswer)], n))
    return BatchStream([a for a in answers if isinstance(a, StreamAnswer)], n, max_event_bytes)


def _sub(dispatcher: Dispatcher, request: ClientRequest, index: int, prompt: Any) -> ClientRequest:
    body = batch.sub_body(request.body, prompt)
    info = protocol.parse_request(Endpoint.COMPLETIONS, body, max_n=protocol.choices(body))
    return ClientRequest(
        body=body,
        info=info,
        record=dispatcher.new_record(request.record.request_id, info),
        headers=request.headers,
        prefill=request.prefill,
        trace=request.trace if index == 0 else None,  # the request's one trace goes with its first prompt
    )


async def _close_all(tasks: Sequence[asyncio.Task[JsonAnswer | StreamAnswer]]) -> None:
    """Cancels every prompt's dispatch; a stream that opened meanwhile is closed."""
    for task in tasks:
        task.cancel()
    await asyncio.wait(tasks)
    for task in tasks:
        if task.cancelled() or task.exception() is not None:
            continue
        answer = task.result()
        if isinstance(answer, StreamAnswer):
            await asyncio.shield(answer.aclose())
