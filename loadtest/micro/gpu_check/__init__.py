"""The GPU check (``python -m loadtest.micro.gpu_check``, ``make gpu-check``): P/D processes with vLLM-shaped KV
caches, block WRITEs through our NIXL backend, SHA-256 of every block. check.py runs it; config.py, caches.py,
peer.py, tp.py and vmm.py are its parts, lowest first."""
