"""Run a module under cProfile switched on and off by signals: `python -m loadtest.bench.profiled OUT MODULE ARGS`.

SIGUSR1 starts profiling (so start-up and imports stay out), SIGUSR2 stops it and writes OUT (pstats format).
Used by the overhead suite to see where the router's time goes under load; the router itself is unchanged.
"""

import cProfile
import runpy
import signal
import sys
from types import FrameType


def main(argv: list[str]) -> None:
    if len(argv) < 2:
        raise SystemExit("usage: python -m loadtest.bench.profiled OUT MODULE [ARGS...]")
    out, module, args = argv[0], argv[1], argv[2:]
    prof = cProfile.Profile()

    def start(signum: int, frame: FrameType | None) -> None:
        prof.enable()

    def stop(signum: int, frame: FrameType | None) -> None:
        prof.disable()
        prof.dump_stats(out)

    signal.signal(signal.SIGUSR1, start)
    signal.signal(signal.SIGUSR2, stop)
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
