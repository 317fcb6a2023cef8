"""Stand-in child for the stack's process tests: a loopback HTTP server with knobs for every way to fail.

usage: python standin.py PORT [--fail CODE] [--die-after SECONDS] [--ignore-term] [--grandchild]
                              [--never-ready]

It prints its pid (and the grandchild's) first, so a test can find every process it should not leave behind.
"""

from __future__ import annotations

import argparse
import http.server
import os
import signal
import subprocess
import sys
import threading


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("port", type=int)
    p.add_argument("--fail", type=int, help="print a reason and exit with this status before serving")
    p.add_argument("--die-after", type=float, help="serve, then exit with status 7 after this many seconds")
    p.add_argument("--ignore-term", action="store_true", help="ignore SIGTERM (only SIGKILL stops it)")
    p.add_argument("--grandchild", action="store_true", help="fork a long sleep in the same process group")
    p.add_argument("--never-ready", action="store_true", help="answer 503 to everything")
    args = p.parse_args()
    print(f"standin pid={os.getpid()}", flush=True)
    if args.fail is not None:
        print("standin: failing on purpose at start-up", flush=True)
        return int(args.fail)
    if args.ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if args.grandchild:
        child = subprocess.Popen(["sleep", "600"])
        print(f"standin grandchild={child.pid}", flush=True)
    status = 503 if args.never_ready else 200

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(status)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, format: str, *items: object) -> None:
            pass  # keep the log to the lines a test looks for

    server = http.server.ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    if args.die_after is not None:

        def die() -> None:
            print("standin: dying now", flush=True)
            server.shutdown()

        threading.Timer(args.die_after, die).start()
        server.serve_forever()
        return 7
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
