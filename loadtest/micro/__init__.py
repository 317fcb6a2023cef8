"""Micro-benchmarks and one-off probes, outside the packages that ship: the GPU check (gpu_check/), descriptor cost
at scale (descriptors.py), notice latency per progress model (notices.py). Each drives our connector's parts
directly; nothing in router/, connector/ or stack/ imports them."""
