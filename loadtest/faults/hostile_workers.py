"""A stand-in vLLM worker that misbehaves on purpose, on a raw asyncio HTTP/1.1 server (no framework).

    python -m loadtest.faults.hostile_workers --port N [--behaviour ok] [--kv-dir DIR] ...

Behaviours of the completion endpoints (/health, /stats and /v1/models always answer):
  ok             prefill legs (kv_transfer_params.do_remote_decode) answer push params after --prefill-delay
                 and, with --kv-dir, "write the KV" (a file named by the transfer id); decode legs wait for
                 that file (the KV) and for --first-byte-delay, then stream --tokens events (--event-pad bytes
                 of padding each) --delay s apart, or one JSON answer
  status500      answer 500 with an OpenAI-style error body
  never-read     read the request line and headers, never the body, never answer
  slow-read      read the body 1 KiB every 0.1 s, then behave as ok
  non-sse        answer a streamed request with one JSON body (content-type application/json)
  no-separators  answer a streamed request with `data: ` and --event-bytes bytes that never end an event

It can be SIGSTOPped (a hang: it accepts connections in the kernel's backlog and answers nothing).
GET /stats: connections (open, total), completions (started, running, finished, aborted: the peer left
while the request ran), bytes of stream sent, health probes answered (a test counts a router's health rounds
by them). Exits on SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


@dataclass
class Stats:
    open_connections: int = 0
    connections_total: int = 0
    started: int = 0
    running: int = 0
    finished: int = 0
    aborted: int = 0
    stream_bytes_sent: int = 0
    health_probes: int = 0


@dataclass(frozen=True)
class HostileOptions:
    behaviour: str
    engine_id: str
    kv_dir: Path | None
    prefill_delay: float
    first_byte_delay: float
    tokens: int
    delay: float
    event_pad: int
    event_bytes: int


class PeerGone(Exception):
    """The router closed the connection while a request ran."""


class HostileWorker:
    def __init__(self, options: HostileOptions) -> None:
        self.o = options
        self.stats = Stats()

    async def connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.stats.open_connections += 1
        self.stats.connections_total += 1
        try:
            while await self._one_request(reader, writer):
                pass
        except (ConnectionError, asyncio.IncompleteReadError, PeerGone):
            pass
        finally:
            self.stats.open_connections -= 1
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    async def _one_request(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Serves one request; False when the connection is to close."""
        head = await reader.readuntil(b"\r\n\r\n")
        request_line, *header_lines = head.decode("latin-1").split("\r\n")
        method, path, _ = request_line.split(" ", 2)
        headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in header_lines if h)}
        length = int(headers.get("content-length", "0") or 0)
        if method == "GET":
            await reader.readexactly(length)
            return await self._get(path, writer)
        if self.o.behaviour == "never-read":
            self.stats.started += 1
            await asyncio.Event().wait()  # holds the connection, reads nothing, answers nothing
        raw = await self._read_body(reader, length)
        body = json.loads(raw or b"{}")
        self.stats.started += 1
        self.stats.running += 1
        try:
            await self._completion(body, reader, writer)
        except (ConnectionError, PeerGone):
            self.stats.aborted += 1
            raise
        finally:
            self.stats.running -= 1
        self.stats.finished += 1
        return True

    async def _read_body(self, reader: asyncio.StreamReader, length: int) -> bytes:
        if self.o.behaviour != "slow-read":
            return await reader.readexactly(length)
        out = bytearray()
        while len(out) < length:
            out += await reader.readexactly(min(1024, length - len(out)))
            await asyncio.sleep(0.1)
        return bytes(out)

    async def _get(self, path: str, writer: asyncio.StreamWriter) -> bool:
        if path == "/health":
            self.stats.health_probes += 1
            await _reply(writer, 200, b"")
        elif path == "/stats":
            await _reply(writer, 200, json.dumps(asdict(self.stats)).encode())
        elif path.startswith("/v1/models"):
            await _reply(writer, 200, json.dumps({"object": "list", "data": [{"id": "tiny"}]}).encode())
        elif path == "/metrics":
            text = f'vllm:num_requests_running{{engine="0"}} {self.stats.running}\n'
            await _reply(writer, 200, text.encode(), b"text/plain")
        else:
            await _reply(writer, 404, b'{"error": {"message": "not found", "type": "not_found", "code": 404}}')
        return True

    async def _completion(self, body: dict[str, Any], reader: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        o = self.o
        if o.behaviour == "status500":
            error = {"error": {"message": "engine failed", "type": "InternalServerError", "code": 500}}
            return await _reply(w, 500, json.dumps(error).encode())
        params = body.get("kv_transfer_params") or {}
        if params.get("do_remote_decode"):
            return await self._prefill(params, reader, w)
        if o.kv_dir is not None and params.get("transfer_id"):
            await _watching(reader, self._kv_arrived(str(params["transfer_id"])))
        if o.first_byte_delay:
            await _watching(reader, asyncio.sleep(o.first_byte_delay))
        if not body.get("stream"):
            await _watching(reader, asyncio.sleep(o.tokens * o.delay))
            return await _reply(w, 200, json.dumps({"id": "cmpl-h", "choices": [{"text": "x" * o.tokens}]}).encode())
        if o.behaviour == "non-sse":
            return await _reply(w, 200, json.dumps({"id": "cmpl-h", "choices": [{"text": "not a stream"}]}).encode())
        await _start_chunked(w, b"text/event-stream")
        if o.behaviour == "no-separators":
            await self._send_chunk(w, b"data: ")
            sent = 0
            while sent < o.event_bytes:
                piece = b"z" * min(2**16, o.event_bytes - sent)
                await self._send_chunk(w, piece)
                sent += len(piece)
        else:
            pad = "p" * o.event_pad
            for i in range(o.tokens):
                event = json.dumps({"choices": [{"index": 0, "text": f"t{i} "}], "pad": pad})
                await self._send_chunk(w, f"data: {event}\n\n".encode())
                if o.delay:
                    await asyncio.sleep(o.delay)
            await self._send_chunk(w, b"data: [DONE]\n\n")
        w.write(b"0\r\n\r\n")
        await w.drain()

    async def _prefill(self, params: dict[str, Any], reader: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        if self.o.prefill_delay:
            await _watching(reader, asyncio.sleep(self.o.prefill_delay))
        if self.o.kv_dir is not None and params.get("transfer_id"):
            (self.o.kv_dir / str(params["transfer_id"])).touch()
        kv = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.o.engine_id,
            "remote_host": "127.0.0.1",
            "remote_port": 5600,
            "tp_size": 1,
            "pp_size": 1,
            "transfer_mode": "push",
        }
        answer = {"id": "cmpl-p", "choices": [{"text": "a"}], "kv_transfer_params": kv}
        await _reply(w, 200, json.dumps(answer).encode())

    async def _kv_arrived(self, transfer_id: str) -> None:
        assert self.o.kv_dir is not None
        while not (self.o.kv_dir / transfer_id).exists():  # noqa: ASYNC110  # another process writes it
            await asyncio.sleep(0.02)

    async def _send_chunk(self, w: asyncio.StreamWriter, data: bytes) -> None:
        w.write(b"%x\r\n%s\r\n" % (len(data), data))
        await w.drain()
        self.stats.stream_bytes_sent += len(data)


async def _watching(reader: asyncio.StreamReader, work: Any) -> None:
    """Awaits `work` unless the peer closes the connection first (then PeerGone)."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(reader.read(1))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            raise PeerGone
        task.result()
    finally:
        for t in (task, gone):
            t.cancel()


async def _reply(w: asyncio.StreamWriter, status: int, body: bytes, content_type: bytes = b"application/json") -> None:
    w.write(
        b"HTTP/1.1 %d X\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n%s" % (status, content_type, len(body), body)
    )
    await w.drain()


async def _start_chunked(w: asyncio.StreamWriter, content_type: bytes) -> None:
    w.write(b"HTTP/1.1 200 OK\r\ncontent-type: %s\r\ntransfer-encoding: chunked\r\n\r\n" % content_type)
    await w.drain()


async def serve(host: str, port: int, options: HostileOptions) -> None:
    worker = HostileWorker(options)
    server = await asyncio.start_server(worker.connection, host, port, limit=2**16)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with server:
        await stop.wait()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument(
        "--behaviour",
        default="ok",
        choices=["ok", "status500", "never-read", "slow-read", "non-sse", "no-separators"],
    )
    p.add_argument("--engine-id", default="hostile")
    p.add_argument("--kv-dir", type=Path)
    p.add_argument("--prefill-delay", type=float, default=0.0)
    p.add_argument("--first-byte-delay", type=float, default=0.0)
    p.add_argument("--tokens", type=int, default=20)
    p.add_argument("--delay", type=float, default=0.02)
    p.add_argument("--event-pad", type=int, default=0)
    p.add_argument("--event-bytes", type=int, default=2**20)
    a = p.parse_args()
    options = HostileOptions(
        behaviour=a.behaviour,
        engine_id=a.engine_id,
        kv_dir=a.kv_dir,
        prefill_delay=a.prefill_delay,
        first_byte_delay=a.first_byte_delay,
        tokens=a.tokens,
        delay=a.delay,
        event_pad=a.event_pad,
        event_bytes=a.event_bytes,
    )
    asyncio.run(serve(a.host, a.port, options))


if __name__ == "__main__":
    main()
