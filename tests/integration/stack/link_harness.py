"""A harness that builds a shaped link with two engine places and a process in one of them, says what it made
(one JSON line), then waits to be killed: the cleanup-after-SIGKILL test runs it.

    python link_harness.py LOG_DIR
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from stack.link.fabric import Link
from stack.link.plan import Shaping
from stack.procs import ManagedProcess, ProcessSpec

PROBE = Path(__file__).with_name("link_probe.py")


def main() -> None:
    log_dir = Path(sys.argv[1])
    link = Link(Shaping.for_rate(1e7)).open()
    p, d = link.add("h-p"), link.add("h-d")
    inside = ManagedProcess(
        ProcessSpec(
            "h-sink",
            (*d.argv_prefix(), sys.executable, str(PROBE), "sink", d.address, "7001"),
            {},
            log_dir / "h-sink.log",
            ready_url="",
        )
    )
    inside.start()
    print(
        json.dumps(
            {
                "holders": link.holder_pids(),
                "host_device": link.host_device,
                "inside": inside.pid,
                "addresses": [p.address, d.address],
            }
        ),
        flush=True,
    )
    time.sleep(120.0)  # killed long before


if __name__ == "__main__":
    main()
