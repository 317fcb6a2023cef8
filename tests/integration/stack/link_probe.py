"""Bounded TCP probes run inside a link's namespaces (stdlib only; every wait ends by itself).

python link_probe.py sink HOST PORT        # accept one connection, count bytes to EOF, print JSON
python link_probe.py send HOST PORT BYTES  # connect (retrying), send BYTES, close, print JSON
python link_probe.py serve HOST PORT       # answer one HTTP GET with 200 (what a router's health check sees)
"""

from __future__ import annotations

import json
import socket
import sys
import time

CAP_S = 60.0


def sink(host: str, port: int) -> None:
    with socket.create_server((host, port)) as server:
        server.settimeout(CAP_S)
        print(json.dumps({"listening": True}), flush=True)
        conn, _ = server.accept()
        with conn:
            conn.settimeout(CAP_S)
            total, t0 = 0, time.monotonic()
            while chunk := conn.recv(1 << 16):
                total += len(chunk)
            print(json.dumps({"bytes": total, "seconds": time.monotonic() - t0}), flush=True)


def send(host: str, port: int, size: int) -> None:
    deadline = time.monotonic() + 10.0
    while True:
        try:
            conn = socket.create_connection((host, port), timeout=CAP_S)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)
    with conn:
        t0 = time.monotonic()
        conn.sendall(b"\0" * size)
        conn.shutdown(socket.SHUT_WR)
        conn.recv(1)  # EOF once the sink has read everything and closed
        print(json.dumps({"bytes": size, "seconds": time.monotonic() - t0}), flush=True)


def serve(host: str, port: int) -> None:
    with socket.create_server((host, port)) as server:
        server.settimeout(CAP_S)
        print(json.dumps({"listening": True}), flush=True)
        conn, _ = server.accept()
        with conn:
            conn.settimeout(CAP_S)
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok")


if __name__ == "__main__":
    what, host, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if what == "sink":
        sink(host, port)
    elif what == "send":
        send(host, port, int(sys.argv[4]))
    else:
        serve(host, port)
