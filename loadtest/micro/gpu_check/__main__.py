"""``python -m loadtest.micro.gpu_check``: the GPU check (check.py)."""

from loadtest.micro.gpu_check.check import main

if __name__ == "__main__":  # not in the spawned peers, which import this module as __mp_main__
    raise SystemExit(main())
