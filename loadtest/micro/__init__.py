"""Micro-benchmarks and one-off probes, kept out of the packages that ship: the GPU check (gpu_check/), descriptor
cost at scale (descriptors.py), notice latency per progress model (notices.py), the KV-event subscriber's capacity
(kv_events_rate.py) and what a prompt's token ids cost (prompt_ids.py). None is a suite; nothing in router/,
connector/ or stack/ imports them."""
