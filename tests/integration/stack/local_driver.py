"""Runs stack.local's supervision (run_supervised + run_stack) with stand-in engines and router.

usage: python local_driver.py LOG_DIR [--engine-flags "FLAGS"] [--router-flags "FLAGS"]
Exactly what `kvpush stack` does after the model is built, with standin.py in place of vLLM and the router.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

from stack.engines import Fleet
from stack.local import run_stack, run_supervised
from stack.procs import ManagedProcess, ProcessSpec, free_port

STANDIN = Path(__file__).with_name("standin.py")


def standin(log_dir: Path, name: str, flags: str) -> ManagedProcess:
    port = free_port()
    return ManagedProcess(
        ProcessSpec(
            name=name,
            argv=(sys.executable, str(STANDIN), str(port), *shlex.split(flags)),
            env=dict(os.environ),
            log_path=log_dir / f"{name}.log",
            ready_url=f"http://127.0.0.1:{port}/ready",
        )
    )


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("log_dir", type=Path)
    p.add_argument("--engine-flags", default="--grandchild")
    p.add_argument("--router-flags", default="")
    args = p.parse_args()

    def body(fleet: Fleet) -> int:
        engines = [standin(args.log_dir, name, args.engine_flags) for name in ("prefill", "decode")]
        return run_stack(
            fleet,
            engines,
            lambda: standin(args.log_dir, "router", args.router_flags),
            startup_timeout=60.0,
            announce=lambda: "kvpush stack ready: stand-ins up",
            poll_interval=0.2,
        )

    return run_supervised(args.log_dir, body)


if __name__ == "__main__":
    sys.exit(main())
