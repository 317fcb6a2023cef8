"""What machine a benchmark ran on: one line, recorded in every result row (`machine`) and shown per run in
bench/README.md, so a table measured on one box is never labelled with the box that rendered the page."""

import os
import platform
from pathlib import Path


def describe() -> str:
    """CPU model, cores, memory and kernel of this machine, e.g. "AMD EPYC, 2 cores, 24 GiB RAM, Linux 6.1"."""
    model = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
        mem_kb = int(Path("/proc/meminfo").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        mem_kb = 0
    return f"{model}, {os.cpu_count()} cores, {mem_kb / 2**20:.0f} GiB RAM, {platform.system()} {platform.release()}"
