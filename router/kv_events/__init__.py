"""KV events: what each engine's prefix cache really holds, from vLLM's own event stream (README.md here).

frames (decode vLLM's msgpack frames) → sequence (one publisher's sequence: gaps, replays, restarts) → stream
(one publisher: frames through its sequence into its index) → index (blocks per worker and DP rank, prompt and
session lookups) → view (what the deciders read); subscriber is the ZMQ I/O (one asyncio task for every
publisher); endpoints and settings say where the engines publish (the `kv_events:` block).
"""
