"""The `kvpush` command: `serve` (the router), `stack` (the local P/D stack), `load`, `sim`, `bench`, `calibrate`.

Each command is imported when chosen, so `kvpush serve` loads no harness and the router never imports this.
"""

from __future__ import annotations

import sys

USAGE = """kvpush <command> [options]

commands:
  serve   run the router (OpenAI-compatible front door for prefill/decode vLLM pools)
  stack   start the local stack: tiny model, one prefill + one decode vLLM CPU instance, the router
  load    run the load generator against an OpenAI endpoint
  sim     run the engine simulator (a fake vLLM prefill or decode worker)
  bench   run the benchmark suites
  calibrate  fit the seed-sim profile's unmeasured numbers to the seed's pull row

`kvpush <command> --help` describes each command's options."""

LOADTEST = {"load": "run", "bench": "bench", "sim": "sim", "calibrate": "calibrate"}  # kvpush name -> loadtest's


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command == "serve":
        from router.cli import serve

        return serve(rest)
    if command == "stack":
        from stack.local import main as stack_main

        return stack_main(rest)
    if command in LOADTEST:
        from loadtest.cli import main as load_main

        return load_main([LOADTEST[command], *rest])
    print(f"kvpush: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2
